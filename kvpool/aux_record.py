"""The AUX row: one fixed-size metadata record per request, sent last in a transfer so that
its arrival means the request's KV has landed."""

import numpy as np

AUX_DTYPE = np.dtype(
    [
        ("room", "<u8"),  # bootstrap room the row belongs to
        ("num_tokens", "<i4"),  # prompt length whose KV the transfer carries
        ("first_token", "<i4"),  # first output token computed by prefill
        ("digest", "V32"),  # engine-defined digest of the request's KV
        ("reserved", "V16"),
    ]
)
AUX_ROW_BYTES = AUX_DTYPE.itemsize
assert AUX_ROW_BYTES == 64
