"""Generated protobuf/gRPC code (`services.rpc.reconfig.v1`, from protos/) and helpers at the RPC edge."""
