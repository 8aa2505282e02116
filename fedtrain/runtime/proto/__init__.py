"""The generated gRPC/protobuf modules of fedtrain's wire protocol (see fedtrain.proto).

`fedtrain_pb2` and `fedtrain_pb2_grpc` are generated and committed; regenerate them
with `python -m fedtrain.runtime.proto.generate` after editing the .proto file.
"""
