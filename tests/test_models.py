"""commfold.cli.demo_model.TPDecoder: the sharded model computes what the unsharded one does
(same seed, same full weights), including a vocab that needs padding and ids at
every shard boundary."""
import torch
import torch.distributed as dist

from commfold.cli.demo_model import DecoderConfig, TPDecoder, greedy_decode, sample_ids


def _sharded_vs_whole(vocab: int) -> dict:
    rank = dist.get_rank()
    # every rank must create every group; each rank keeps the one holding only itself
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    cfg = DecoderConfig(vocab=vocab, hidden=32, layers=2, heads=4, ffn=64)
    sharded, whole = TPDecoder(cfg), TPDecoder(cfg, group=alone)
    shard_vocab = -(-vocab // dist.get_world_size())
    edges = [0, shard_vocab - 1, shard_vocab, vocab - 1]  # both sides of the shard boundary
    ids = torch.cat([sample_ids(cfg, 3, 6), torch.tensor([edges + edges[:2]])])
    with torch.no_grad():
        return {
            "embed": (sharded.embed_tokens(ids) - whole.embed_tokens(ids)).abs().max().item(),
            "hidden": (sharded.hidden_states(ids) - whole.hidden_states(ids)).abs().max().item(),
            "logits_shape": tuple(sharded.logits(sharded.hidden_states(ids)).shape),
            "tokens": greedy_decode(sharded, ids, 3).tolist(),
            "tokens_whole": greedy_decode(whole, ids, 3).tolist(),
            "padding_rows": sharded.embed[vocab - rank * shard_vocab:].abs().sum().item()
            if vocab - rank * shard_vocab < shard_vocab else 0.0,
        }


def test_sharded_decoder_equals_unsharded(ranks2):
    for vocab in (1000, 1001):  # divisible, padded
        out = ranks2.run(_sharded_vs_whole, vocab)
        for r in out:
            assert r["embed"] == 0.0  # one nonzero row per id: exact
            assert r["hidden"] < 1e-4
            assert r["logits_shape"] == (4, 6, vocab)
            assert r["tokens"] == r["tokens_whole"]
            assert r["padding_rows"] == 0.0
        assert out[0]["tokens"] == out[1]["tokens"]
