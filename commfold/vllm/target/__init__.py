"""The target model's token pick from the vocab shards (V1's runner, Model Runner V2
up to 0.33, 0.34's ``ModelState``), the step decision and its cost rule."""
