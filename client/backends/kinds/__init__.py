"""The backend kinds of the gateway, one module each (Triton's lives in ``client.triton``).

Their table, :data:`client.config.kinds.KINDS`, lives where the gateway config is assembled
from their sections, so that no kind imports the config.
"""
