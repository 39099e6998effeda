"""Stand-in for ``sglang.srt.environ``: the flags the Triton LoRA ops read, at their defaults."""


class _Flag:
    def get(self):
        return False


class _Envs:
    def __getattr__(self, name):
        return _Flag()


envs = _Envs()
