"""vllm.logger: init_logger, a standard logger with vllm's ``*_once`` methods."""
import logging


class _Logger(logging.LoggerAdapter):
    """logging.Logger plus debug_once/info_once/warning_once (each message logged once)."""

    def __init__(self, logger):
        super().__init__(logger, {})
        self._seen = set()

    def process(self, msg, kwargs):
        return msg, kwargs

    def _once(self, level, msg, *args, **kwargs):
        key = (level, msg, args)
        if key not in self._seen:
            self._seen.add(key)
            self.log(level, msg, *args, **kwargs)

    def debug_once(self, msg, *args, **kwargs):
        self._once(logging.DEBUG, msg, *args, **kwargs)

    def info_once(self, msg, *args, **kwargs):
        self._once(logging.INFO, msg, *args, **kwargs)

    def warning_once(self, msg, *args, **kwargs):
        self._once(logging.WARNING, msg, *args, **kwargs)


def init_logger(name: str) -> _Logger:
    return _Logger(logging.getLogger(name))
