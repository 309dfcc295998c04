"""The control-plane protocol: ``pdserve.proto`` and its generated stubs.

``PROTOCOL_VERSION`` is checked at registration together with the compatibility hash
(`engine.config.compatibility_hash`); bump it on any incompatible change to the .proto.
"""

PROTOCOL_VERSION = 7
