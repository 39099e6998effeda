"""Stand-in for ``sglang.srt.server_args``: ``ServerArgs``, which the ``csgmv`` backend's
constructor takes and does not read (its chunk size comes from ``runtime_context.get_lora``)."""


class ServerArgs:
    """Type annotations only."""
