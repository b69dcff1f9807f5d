"""Generated protobuf and gRPC modules for stagediff.v1 (do not edit)."""
