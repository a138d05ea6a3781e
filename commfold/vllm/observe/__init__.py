"""What commfold shows of an engine run: per-step collective logs, their checks, and
`commfold doctor`."""
