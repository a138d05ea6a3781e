"""The rewrites, one module each: PASSES maps each pass name of the registry
(commfold.config.ALL_PASSES, in the order they run) to the run(ctx) of the module of
that name here. A new pass is a module here plus its name in ALL_PASSES."""
from importlib import import_module

from commfold.config import ALL_PASSES

PASSES = {name: import_module(f"{__name__}.{name}").run for name in ALL_PASSES}
