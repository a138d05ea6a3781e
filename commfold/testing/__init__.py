"""Test and benchmark support: run code on N gloo ranks of this machine, and observe
which collectives really ran."""
from .comm_log import CommEvent, CommLog, record_collectives  # noqa: F401
from .ranks import RankError, RankPool, free_port, run_on_ranks  # noqa: F401
