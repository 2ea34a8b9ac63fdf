"""The bridge's gRPC contract: ``fedgc_bridge.proto`` and its generated, committed stubs."""
