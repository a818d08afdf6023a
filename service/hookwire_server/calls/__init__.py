"""One module per kind of call (Infer, Generate, Tokenize, GetParameters, harvest
jobs): validate, admit, hand work to the engine, shape the replies. No grpc."""
