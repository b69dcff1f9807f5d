"""The frame-interpolation stage: optical-flow interpolation between decoded frames."""
