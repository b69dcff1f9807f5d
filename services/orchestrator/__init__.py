"""The orchestrator: the public Generation API, the job queue, and the chain of stage calls."""
