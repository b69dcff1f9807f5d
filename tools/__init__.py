"""Offline tools run against a checkpoint in one process, outside the serving stages: each is a `stagediff`
server command (stagediff/cli.py) and may use any stage's runtime, which the stages themselves never do to one
another."""
