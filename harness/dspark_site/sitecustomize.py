"""On PYTHONPATH in place of harness/v2_site for a DSpark engine on Model Runner V2 (tests
only; harness.triton_cpu.v2_engine_env("dspark_site")): the V2 stand-in as harness/v2_site
registers it, and, with COMMFOLD_TEST_DSPARK_SHARDED=1, vLLM's DSpark Markov head built
sharded in every process, as before vLLM replicated it by hand: ``markov_w1`` a
VocabParallelEmbedding, ``markov_w2`` a ParallelLMHead without ``disable_tp``. The
head's module is patched when it is first imported (an import hook), so no process
imports vLLM early."""
import importlib.abc
import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
from harness import triton_cpu  # noqa: E402

triton_cpu.install()

MODULE = "vllm.model_executor.models.qwen3_dspark"


def _shard(module) -> None:
    from vllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead,
                                                                     VocabParallelEmbedding)

    def __init__(self, vocab_size, draft_vocab_size, markov_rank, prefix,
                 quant_config=None, retain_weight_for_gather=False):
        module.nn.Module.__init__(self)
        self.markov_w1 = VocabParallelEmbedding(vocab_size, markov_rank,
                                                prefix=f"{prefix}.markov_w1")
        self.markov_w2 = ParallelLMHead(draft_vocab_size, markov_rank, bias=False,
                                        quant_config=quant_config, prefix=f"{prefix}.markov_w2")
        self.markov_w2._retain_weight_for_gather = retain_weight_for_gather
        self.markov_w2.is_w4a16_nvfp4 = False

    module.DSparkMarkovHead.__init__ = __init__


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def patched(module):
            exec_module(module)
            _shard(module)
        spec.loader.exec_module = patched
        return spec


if os.environ.get("COMMFOLD_TEST_DSPARK_SHARDED") == "1":
    sys.meta_path.insert(0, _Finder())
