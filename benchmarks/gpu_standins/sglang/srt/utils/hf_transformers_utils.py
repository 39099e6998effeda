"""Stand-in for ``sglang.srt.utils.hf_transformers_utils``: ``AutoConfig`` (annotations only)."""


class AutoConfig:
    pass
