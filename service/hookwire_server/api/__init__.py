"""The gRPC face: the server, its servicers (protobuf in, domain calls, protobuf out),
request bounds checked on raw bytes, the status mapping, credentials and the config file."""
