"""What every StageDiff server shares: bootstrap, wire codec, checkpoints, process groups."""
