"""vLLM's DSpark Markov head built sharded, as before vLLM replicated it by hand (tests
only): ``markov_w1`` a VocabParallelEmbedding, ``markov_w2`` a ParallelLMHead without
``disable_tp``. ``install()`` patches the head's module when it is first imported (an
import hook), so no process imports vLLM early; harness/v2_site's sitecustomize calls
it in every engine process when HARNESS_DSPARK_SHARDED=1."""
from harness.import_hook import after_import

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


def install() -> None:
    """Build the head sharded in this process (before vLLM's module is imported)."""
    after_import(MODULE, _shard)
