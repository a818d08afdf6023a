"""Generated protobuf and gRPC stubs for hookwire.v1 (do not edit)."""
