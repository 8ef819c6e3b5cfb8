"""One engine start in a fresh process, with JAX's persistent compilation cache in a directory
(``tests/test_executable_store.py``): ``python -m tests.store_worker DIR on|off`` (the executable
store on or off) prints a JSON line: what warm-up loaded, compiled and stored, and the greedy
tokens of two prompts."""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["JBATCH_COMPILATION_CACHE"] = sys.argv[1]
    import jax

    from jbatch import LLM, compile_cache
    from jbatch.demo import demo_model_path
    from jbatch.engine.executable_store import ExecutableStore
    from tests.test_executable_store import GREEDY, PROMPTS, SMALL

    compile_cache.enable(sys.argv[1])
    # Every program goes to JAX's cache, however fast it compiles (the test needs them there).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    compile_cache.from_env = lambda default=None: None  # LLM(...) would reset the threshold
    if sys.argv[2] == "off":
        ExecutableStore.from_compilation_cache = classmethod(lambda cls: None)
    llm = LLM(str(demo_model_path()), **SMALL)
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]
    print(json.dumps(dict(programs=llm.engine.core.warmup_programs, tokens=tokens)))
