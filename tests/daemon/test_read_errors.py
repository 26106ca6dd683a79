"""The read-error policy as a table: (error, mode, retries, host_only) -> action."""
import errno

import pytest

from deepseek_flash.daemon.read_errors import RETRY, ReadAction, read_error_action
from deepseek_flash.errors import BlockChecksumError, FlashIOError, StoreTruncated


def io(code):
    return FlashIOError(f"read failed: errno {code}", errno=code, path="/s/blocks.dat", offset=0,
                        block_id=3)


CRC = BlockChecksumError("crc mismatch", block_id=3, path="/s/blocks.dat", expected=1)
SHORT = StoreTruncated("/s/blocks.dat ends early", path="/s/blocks.dat", block_id=3, offset=0, length=8192)
FAILED_STRICT = ReadAction(fail_model=True)
GRACEFUL_GIVE_UP = ReadAction(try_copies=True)
DEVICE_GONE_STRICT = ReadAction(device_lost=True, fail_model=True)
DEVICE_GONE_GRACEFUL = ReadAction(device_lost=True, host_only=True, try_copies=True)

TABLE = [
    # error, mode, retries, host_only -> action
    (io(errno.EIO), "strict", 0, False, DEVICE_GONE_STRICT),
    (io(errno.EIO), "graceful", 0, False, RETRY),
    (io(errno.EIO), "graceful", 1, False, DEVICE_GONE_GRACEFUL),
    # already host-only: no retry, no second switch
    (io(errno.EIO), "graceful", 0, True, ReadAction(device_lost=True, try_copies=True)),
    (io(errno.ENOENT), "graceful", 1, False, DEVICE_GONE_GRACEFUL),
    (io(errno.ENXIO), "strict", 0, False, DEVICE_GONE_STRICT),
    (io(errno.EROFS), "graceful", 1, False, DEVICE_GONE_GRACEFUL),
    # an errno that is not the device's: one bad read, the model stays on its device
    (io(errno.EINVAL), "strict", 0, False, FAILED_STRICT),
    (io(errno.EINVAL), "graceful", 1, False, GRACEFUL_GIVE_UP),
    (io(errno.ENOMEM), "graceful", 0, False, RETRY),
    # a checksum mismatch quarantines the block, never the device
    (CRC, "strict", 0, False, ReadAction(quarantine=True, fail_model=True)),
    (CRC, "graceful", 0, False, RETRY),
    (CRC, "graceful", 1, False, ReadAction(quarantine=True, try_copies=True)),
    (CRC, "graceful", 0, True, ReadAction(quarantine=True, try_copies=True)),
    # a data file that ends early is a corrupt store, not a dead device (errno 0 is no device error)
    (SHORT, "strict", 0, False, ReadAction(quarantine=True, fail_model=True)),
    (SHORT, "graceful", 1, False, ReadAction(quarantine=True, try_copies=True)),
    (io(0), "graceful", 1, False, GRACEFUL_GIVE_UP),
    (io(0), "strict", 0, False, FAILED_STRICT),
]


@pytest.mark.parametrize("error, mode, retries, host_only, action", TABLE)
def test_read_error_policy(error, mode, retries, host_only, action):
    assert read_error_action(error, mode, retries, host_only) == action
