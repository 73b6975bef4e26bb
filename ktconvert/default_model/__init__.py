"""The embedded default model: a small DeepSeek-V3-architecture MoE trained by this project on the Python standard
library's source. data (training text), train (`python -m ktconvert.default_model.train`), export (hub layout),
card (its README), demo (`make demo`: convert it and generate). The weights ship in ktconvert/data/default_model/."""
