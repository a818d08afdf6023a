"""The contract's Python home: what the server, the SDK and the ``hookwire`` command
must agree on byte for byte, beyond the generated messages of ``hookwire.v1``.

Public and documented; both packages import it (the server imports from the SDK
only ``hookwire.wire`` and ``hookwire.v1``, never a private ``hookwire._*`` module,
which tests/unit/test_architecture.py checks).

- :mod:`hookwire.wire.codec`: Python values and tensors as ``hookwire.v1.Value`` /
  ``Tensor`` (dtype, shape, raw little-endian bytes; nothing is ever unpickled), large
  tensors split into TensorChunks (``Chunker``) and put back together
  (``ChunkAssembler``). Imports torch with the first tensor it decodes, never before.
- :mod:`hookwire.wire.framing`: TensorChunk messages written and read by hand (one copy
  of a tensor's bytes each way), byte-identical to protobuf's own encoding; the stream
  fields chunks travel in; the protobuf varint reader and writer.
- :mod:`hookwire.wire.ids`: the formats of the ids a server hands out (hooks
  ``hk_...``, sessions ``ses_...``, requests ``req_...``, harvest jobs ``hv-...``): the
  generator the server uses and the patterns clients check typed ids against.
- :mod:`hookwire.wire.harvest_format`: the activation dataset format (shards, worker
  manifests, the merged manifest) and its crash-safe writer, used by the server's
  harvest jobs and by the client sink alike.
- :mod:`hookwire.wire.harvest_sources`: text sources, tokenized contexts, batches and
  plans of a harvest. A contract too: a server job and a client sink given the same
  files and settings must produce bit-identical batches.

Importing this package imports none of its modules: each is imported where used (the
``hookwire`` command's start-up stays fast; see tests/unit/test_fast_cli.py).
"""

#: The version of hookwire (``hookwire.__version__``): the SDK, the server and this
#: contract ship together. Activation datasets record it (``hookwire_version``).
__version__ = "0.1.0"
