"""A small Hugging Face hub on 127.0.0.1 for tests: a real HTTP server speaking the endpoints huggingface_hub uses.

Endpoints: GET /api/models/{org}/{name}[/revision/{rev}] (model info with `sha`), GET /api/models/{org}/{name}/tree/
{rev}?recursive=&expand=&cursor= (paged with a Link header; sizes, git oids, LFS sha256), HEAD/GET
/{org}/{name}/resolve/{rev}/{path} (regular files served directly with ETag = git oid; LFS files answered with a
302 to /cdn/{sha256} plus X-Linked-Etag / X-Linked-Size, like the hub), Range requests (206 + Content-Range),
X-Repo-Commit, and the hub's error headers (X-Error-Code RepoNotFound / RevisionNotFound / GatedRepo). No xet headers
are ever sent, so clients use plain HTTP. Knobs on `FakeHub` let a test cut, stall or corrupt one transfer.
"""
from __future__ import annotations

import hashlib
import json
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlsplit

import numpy as np
from safetensors.numpy import save as save_safetensors

LFS_SUFFIXES = (".safetensors", ".bin")


def git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\n" \
           f"size {len(data)}\n".encode()


@dataclass
class FakeRepo:
    repo_id: str
    commits: dict[str, dict[str, bytes]]  # commit sha -> {path: content}
    refs: dict[str, str]  # branch/tag -> commit sha
    gated: bool = False

    def resolve(self, rev: str) -> str | None:
        return self.refs.get(rev) or (rev if rev in self.commits else None)


def checkpoint_files(version: int, n_shards: int = 2) -> dict[str, bytes]:
    """A tiny MoE-shaped checkpoint: safetensors shards + index, configs, tokenizer files, a .bin, extras."""
    rng = np.random.default_rng(version)
    files, weight_map, total = {}, {}, 0
    for s in range(n_shards):
        name = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        tensors = {f"model.layers.{s}.mlp.experts.{e}.up_proj.weight": rng.standard_normal((64, 96), dtype=np.float32)
                   for e in range(4)}
        tensors[f"model.layers.{s}.self_attn.q_proj.weight"] = rng.standard_normal((64, 64), dtype=np.float32)
        files[name] = save_safetensors(tensors, metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
        total += sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    files["model.safetensors.index.json"] = json.dumps(index, indent=2).encode()
    files["config.json"] = json.dumps({"model_type": "tiny_moe", "fixture_version": version,
                                       "num_hidden_layers": n_shards, "n_routed_experts": 4}).encode()
    files["generation_config.json"] = b'{"do_sample": false}'
    files["tokenizer.json"] = json.dumps({"version": "1.0", "model": {"type": "WordLevel",
                                          "vocab": {"<unk>": 0, "hi": 1}, "unk_token": "<unk>"}}).encode()
    files["tokenizer_config.json"] = b'{"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}'
    files["special_tokens_map.json"] = b'{"unk_token": "<unk>"}'
    files["pytorch_model.bin"] = rng.bytes(4096)  # stands for a pickle: must never be pulled by default
    files["README.md"] = b"# tiny moe\n"
    files[".gitattributes"] = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
    files["inference/convert.py"] = b"print('remote code')\n"
    return files


def fixture_repos() -> dict[str, FakeRepo]:
    def sha(text: str) -> str:
        return hashlib.sha1(text.encode()).hexdigest()

    v1, v2 = sha("tiny-moe v1"), sha("tiny-moe v2")
    tiny = FakeRepo("tiny-org/tiny-moe", {v1: checkpoint_files(1), v2: checkpoint_files(2)}, {"main": v2, "v1.0": v1})
    g = sha("gated v1")
    gated = FakeRepo("tiny-org/gated-moe", {g: checkpoint_files(3)}, {"main": g}, gated=True)
    e = sha("evil v1")
    evil = FakeRepo("evil-org/traversal", {e: {"config.json": b"{}", "../escape.safetensors": b"x" * 64}}, {"main": e})
    b = sha("big v1")  # one shard larger than huggingface_hub's 10 MiB download chunk
    big_shard = save_safetensors({"w": np.random.default_rng(4).standard_normal(3 << 20, dtype=np.float32)})
    big = FakeRepo("tiny-org/big-moe", {b: {"config.json": b"{}", "model.safetensors": big_shard}}, {"main": b})
    return {r.repo_id: r for r in (tiny, gated, evil, big)}


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo] = field(default_factory=fixture_repos)
    token: str = "hf_fake_valid_token"
    page_size: int = 1000  # tree entries per page
    cut_once: dict = field(default_factory=dict)  # path -> bytes the next GET sends before dropping the connection
    stall: dict = field(default_factory=dict)  # path -> bytes sent before the GET hangs until `release` is set
    corrupt_once: set = field(default_factory=set)  # paths: next GET serves one flipped byte
    corrupt_always: set = field(default_factory=set)
    log: list = field(default_factory=list)  # one dict per request
    stalled: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def start(self) -> FakeHub:
        hub = self
        self.blobs = {hashlib.sha256(data).hexdigest(): data for repo in self.repos.values()
                      for files in repo.commits.values() for data in files.values()}

        class Handler(_Handler):
            fake = hub

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def reset(self) -> None:
        self.cut_once.clear(), self.stall.clear(), self.corrupt_once.clear(), self.corrupt_always.clear()
        self.log.clear(), self.stalled.clear(), self.release.clear()
        self.page_size = 1000

    def downloads(self, path: str | None = None) -> list[dict]:
        """Logged GETs that carried file bytes (the CDN step for LFS files, resolve for regular files)."""
        return [r for r in self.log if r["method"] == "GET" and r.get("file") and r["status"] in (200, 206)
                and (path is None or r["file"] == path)]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake: FakeHub

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self._route(head=True)

    def do_GET(self):
        self._route(head=False)

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str, head: bool) -> None:
        body = json.dumps({"error": message}).encode()
        self._send(status, body, {"X-Error-Code": code, "X-Error-Message": message,
                                  "Content-Type": "application/json"}, head)

    def _route(self, head: bool) -> None:
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.split("/")[1:]]
        entry = {"method": self.command, "path": url.path, "range": self.headers.get("Range"), "status": None}
        self.fake.log.append(entry)
        try:
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                self._api(parts[2] + "/" + parts[3], parts[4:], parse_qs(url.query), entry, head)
            elif parts[0] == "cdn" and len(parts) == 2:
                entry["file"] = parse_qs(url.query)["file"][0]
                self._serve_bytes(entry["file"], self._blob(parts[1]), entry, head)
            elif len(parts) >= 5 and parts[2] == "resolve":
                self._resolve(parts[0] + "/" + parts[1], parts[3], "/".join(parts[4:]), entry, head)
            else:
                entry["status"] = 404
                self._error(404, "EntryNotFound", "no such endpoint", head)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _repo(self, repo_id: str, entry: dict, head: bool) -> FakeRepo | None:
        repo = self.fake.repos.get(repo_id)
        if repo is None:
            entry["status"] = 404
            self._error(404, "RepoNotFound", "Repository not found", head)
        return repo

    def _commit(self, repo: FakeRepo, rev: str, entry: dict, head: bool) -> str | None:
        sha = repo.resolve(rev)
        if sha is None:
            entry["status"] = 404
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
        return sha

    def _api(self, repo_id: str, rest: list[str], query: dict, entry: dict, head: bool) -> None:
        repo = self._repo(repo_id, entry, head)
        if repo is None:
            return
        if not rest or rest[0] == "revision":
            sha = self._commit(repo, rest[1] if rest else "main", entry, head)
            if sha is None:
                return
            info = {"_id": sha[:24], "id": repo_id, "modelId": repo_id, "sha": sha, "private": False,
                    "gated": "manual" if repo.gated else False, "disabled": False,
                    "siblings": [{"rfilename": p} for p in sorted(repo.commits[sha])]}
            entry["status"] = 200
            return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)
        if rest[0] == "tree" and len(rest) >= 2:
            sha = self._commit(repo, rest[1], entry, head)
            if sha is not None:
                self._tree(repo, sha, query, entry, head)
            return
        entry["status"] = 404
        self._error(404, "EntryNotFound", "no such endpoint", head)

    def _tree(self, repo: FakeRepo, sha: str, query: dict, entry: dict, head: bool) -> None:
        files = repo.commits[sha]
        dirs = sorted({"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)})
        items = [{"type": "directory", "oid": git_oid(d.encode()), "size": 0, "path": d} for d in dirs]
        for path, data in sorted(files.items()):
            item = {"type": "file", "size": len(data), "path": path}
            if path.endswith(LFS_SUFFIXES):
                pointer = lfs_pointer(data)
                item.update(oid=git_oid(pointer), lfs={"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                                                       "pointerSize": len(pointer)})
            else:
                item.update(oid=git_oid(data))
            items.append(item)
        if query.get("recursive", ["false"])[0] != "true":
            items = [i for i in items if "/" not in i["path"]]
        start = int(query.get("cursor", ["0"])[0])
        page = items[start:start + self.fake.page_size]
        headers = {"Content-Type": "application/json"}
        if start + self.fake.page_size < len(items):
            nxt = f"{self.fake.url}/api/models/{repo.repo_id}/tree/{sha}?recursive={query.get('recursive', ['false'])[0]}" \
                  f"&expand={query.get('expand', ['false'])[0]}&cursor={start + self.fake.page_size}"
            headers["Link"] = f'<{nxt}>; rel="next"'
        entry["status"] = 200
        self._send(200, json.dumps(page).encode(), headers, head)

    def _blob(self, sha256: str) -> bytes:
        return self.fake.blobs[sha256]

    def _resolve(self, repo_id: str, rev: str, path: str, entry: dict, head: bool) -> None:
        repo = self._repo(repo_id, entry, head)
        if repo is None:
            return
        if repo.gated and self.headers.get("Authorization") != f"Bearer {self.fake.token}":
            entry["status"] = 401
            return self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access "
                                                 "to it and be authenticated to access it. Please log in.", head)
        sha = self._commit(repo, rev, entry, head)
        if sha is None:
            return
        data = repo.commits[sha].get(path)
        if data is None:
            entry["status"] = 404
            return self._error(404, "EntryNotFound", f"{path} does not exist on {rev}", head)
        common = {"X-Repo-Commit": sha, "Accept-Ranges": "bytes"}
        if path.endswith(LFS_SUFFIXES):
            digest = hashlib.sha256(data).hexdigest()
            entry["status"] = 302
            return self._send(302, b"", {**common, "Location": f"{self.fake.url}/cdn/{digest}?file={quote(path)}",
                                         "ETag": f'"{git_oid(lfs_pointer(data))}"', "X-Linked-Etag": f'"{digest}"',
                                         "X-Linked-Size": len(data)}, head)
        entry["file"] = path
        self._serve_bytes(path, data, entry, head, {**common, "ETag": f'"{git_oid(data)}"'})

    def _serve_bytes(self, path: str, data: bytes, entry: dict, head: bool, extra: dict | None = None) -> None:
        fake, size, start, end = self.fake, len(data), 0, len(data) - 1
        headers = {"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream", **(extra or {})}
        rng = self.headers.get("Range")
        if rng:
            first, _, last = rng.removeprefix("bytes=").partition("-")
            start, end = int(first), int(last) if last else size - 1
            if start >= size:
                entry["status"] = 416
                return self._send(416, b"", {"Content-Range": f"bytes */{size}"}, head)
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        body = bytearray(data[start:end + 1])
        status = 206 if rng else 200
        entry["status"] = status
        if not head and (path in fake.corrupt_always or path in fake.corrupt_once):
            fake.corrupt_once.discard(path)
            body[len(body) // 2] ^= 0xFF
        send_limit, hang = len(body), False
        if not head and path in fake.cut_once:
            send_limit = min(fake.cut_once.pop(path), len(body))
        elif not head and path in fake.stall:
            send_limit, hang = fake.stall.pop(path), True
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, str(v))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if head:
            return
        self.wfile.write(bytes(body[:send_limit]))
        self.wfile.flush()
        entry["sent"] = send_limit
        if send_limit < len(body):  # simulate a dropped connection (after hanging, for `stall`)
            if hang:
                fake.stalled.set()
                fake.release.wait(30)
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
