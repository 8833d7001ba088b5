"""Load LMCache config files the way LMCache's vLLM adapter does, and report what LMCache made of them.

Runs in a process of its own (`python lmcache_check.py FILE...`: no LMCACHE_* variables, nothing else imported)
and prints one JSON object per file: the keys LMCache recognised as set, their loaded values, the warnings it
logged (unknown or deprecated keys are only warnings in LMCache, and dropped), and the error if loading or
validation failed.
"""

import json
import logging
import sys

from lmcache.v1.config import LMCacheEngineConfig


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def check(path: str) -> dict:
    collect = Collect()
    # LMCache's loggers do not propagate; listen on the ones its config loader logs to.
    loggers = [logging.getLogger(name) for name in ("lmcache.v1.config_base", "lmcache.v1.config")]
    for logger in loggers:
        logger.addHandler(collect)
    try:
        config = LMCacheEngineConfig.from_file(path)  # as lmcache.integration.vllm.utils does, then:
        config.update_config_from_env()  # env overrides, then config.validate()
        user_set = sorted(config._user_set_keys)
        return {"ok": True, "user_set": user_set, "values": {k: getattr(config, k) for k in user_set},
                "warnings": collect.messages}
    except (AssertionError, ValueError, TypeError) as error:
        return {"ok": False, "error": f"{type(error).__name__}: {error}", "warnings": collect.messages}
    finally:
        for logger in loggers:
            logger.removeHandler(collect)


if __name__ == "__main__":
    print(json.dumps({path: check(path) for path in sys.argv[1:]}, default=str))
