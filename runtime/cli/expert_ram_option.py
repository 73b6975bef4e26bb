"""The RAM-tier options shared by `ktrun generate|bench|serve` (--expert-ram SIZE and its knobs; ktrun.experts.ram_tier).
Torch-free: imported by the CLIs before torch loads."""
from __future__ import annotations

from dataclasses import dataclass

import click

from ..byte_sizes import parse_bytes

IO_MODES = ("direct", "pread")      # ktrun.experts.ram_tier.IO_MODES (that module imports numpy; this one stays light)
PREDICTORS = ("router", "coact")    # ktrun.experts.prediction.PREDICTORS


@dataclass(frozen=True)
class ExpertRamOptions:
    budget_bytes: int               # RAM the routed experts may occupy, in bytes
    predict: bool = True            # read the next layer's predicted experts ahead
    io: str = "direct"              # direct: O_DIRECT preads (no page-cache copy); pread: buffered, then dropped
    io_threads: int = 4             # reads in flight
    extra: int = 0                  # predicted experts per token beyond top-k
    predictor: str = "router"       # router: next layer's router on this layer's input; coact: co-activation counts


def expert_ram_options(f):
    """Decorator adding --expert-ram, --expert-ram-predict/--no-expert-ram-predict, --expert-ram-io,
    --expert-ram-io-threads, --expert-ram-predictor, --expert-ram-extra to a click command."""
    opts = [
        click.option("--expert-ram", "ram_budget", default=None, metavar="SIZE",
                     help="Keep at most SIZE of routed experts in RAM (e.g. 200GB) and read the rest from the expert "
                          "files on demand, whole experts at a time: for models larger than RAM. Must hold one MoE "
                          "layer's experts. Outputs are bit-identical to the all-in-RAM run."),
        click.option("--expert-ram-predict/--no-expert-ram-predict", "ram_predict", default=True, show_default=True,
                     help="With --expert-ram: predict the next layer's experts through its router from the current "
                          "hidden state and read them while this layer computes."),
        click.option("--expert-ram-io", "ram_io", type=click.Choice(IO_MODES), default="direct", show_default=True,
                     help="With --expert-ram: direct = O_DIRECT reads (falls back to buffered where the file system "
                          "has none); pread = buffered reads whose page cache is dropped after each expert."),
        click.option("--expert-ram-io-threads", "ram_io_threads", type=click.IntRange(1, 64), default=4,
                     show_default=True, help="With --expert-ram: reads in flight."),
        click.option("--expert-ram-predictor", "ram_predictor", type=click.Choice(PREDICTORS), default="router",
                     show_default=True,
                     help="With --expert-ram: router = the next layer's router on this layer's MoE input; coact = "
                          "how often experts of consecutive layers were routed together (learned online), the "
                          "previous token's choice where nothing is learned yet."),
        click.option("--expert-ram-extra", "ram_extra", type=click.IntRange(0), default=0, show_default=True,
                     help="With --expert-ram: predicted experts per token beyond the router's top-k."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def expert_ram_from(kw: dict) -> ExpertRamOptions | None:
    """Pop the ram_* options of a click command's kwargs -> ExpertRamOptions, or None without --expert-ram."""
    budget, predict = kw.pop("ram_budget", None), kw.pop("ram_predict", True)
    io, threads, extra = kw.pop("ram_io", "direct"), kw.pop("ram_io_threads", 4), kw.pop("ram_extra", 0)
    predictor = kw.pop("ram_predictor", "router")
    if budget is None:
        return None
    return ExpertRamOptions(parse_bytes(budget, "--expert-ram"), predict, io, threads, extra, predictor)
