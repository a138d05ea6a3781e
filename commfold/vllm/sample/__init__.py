"""Model Runner V2's sampled step drawn on one rank's vocab shard: processing, the
top-k / top-p cut, grammars, the Gumbel draw."""
