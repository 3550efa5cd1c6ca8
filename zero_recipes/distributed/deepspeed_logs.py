"""DeepSpeed's logger, quietened: its warnings and fp16 overflow lines kept, its INFO chatter dropped."""

from __future__ import annotations

import os


def quiet_deepspeed() -> None:
    """DeepSpeed logs every bucket and timer at INFO; keep its warnings, drop the chatter
    (ZERO_RECIPES_DEBUG=1 brings it back)."""
    import logging

    from deepspeed.utils import logger

    if not os.environ.get("ZERO_RECIPES_DEBUG") and not any(
        isinstance(f, _KeepWarningsAndOverflows) for f in logger.filters
    ):
        logger.setLevel(logging.INFO)
        logger.addFilter(_KeepWarningsAndOverflows())


class _KeepWarningsAndOverflows:
    """DeepSpeed reports an fp16 overflow (the skipped step and its loss scale) at INFO, among hundreds of
    INFO lines of chatter; keep those and the warnings."""

    def filter(self, record) -> bool:
        import logging

        return record.levelno >= logging.WARNING or "OVERFLOW" in str(record.msg)
