"""Quiet libtpu on a machine without TPUs (standard library only: importing it loads no JAX).

With libtpu installed (the ``tpu`` and ``test`` extras), JAX tries the TPU backend in every
process, and libtpu, finding no TPU metadata, prints warnings about TPU_ACCELERATOR_TYPE and
TPU_WORKER_HOSTNAMES on every start, writes a log directory (/tmp/tpu_logs/) and log files
(/tmp/tpu_driver.*), and takes a machine-wide lock file (/tmp/libtpu_lockfile), so that a second
JAX process at the same time cannot use libtpu at all (ahead-of-time compilation for a TPU
topology, `stabledrl_jax.tpu_compile`, fails with "Internal error when accessing libtpu
multi-process lockfile"). Where no TPU chip is attached,
`quiet_without_tpu` sets (unless already set) the variables that answer libtpu's questions for a
one-host, compile-only use and allow several processes to load it. On a TPU host it sets nothing.
It must run before JAX initializes its backends; `stabledrl_jax/__init__.py` calls it.
"""

from __future__ import annotations

import glob
import os
import pathlib

_GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips are PCI devices of this vendor.

QUIET_ENV = {
    "TPU_SKIP_MDS_QUERY": "1",  # no GCE metadata server to ask
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_HOST_BOUNDS": "1,1,1",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",  # no chip to guard: no lock file
    "TPU_LOG_DIR": "disabled",  # no /tmp/tpu_logs/ from a process that runs on no TPU
    # libtpu's driver logs through glog into $TMPDIR (tpu_driver.*.INFO / .WARNING, two files a
    # process, even with TPU_LOG_DIR disabled); at FATAL only it opens none. Compile errors and
    # out-of-memory still come back as Python exceptions.
    "TPU_MIN_LOG_LEVEL": "3",
}


def tpu_attached() -> bool:
  """Whether a Google PCI device (a TPU chip) is attached to this machine."""
  for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
    try:
      if pathlib.Path(vendor).read_text().strip() == _GOOGLE_PCI_VENDOR:
        return True
    except OSError:
      continue
  return False


def log_into(workdir: str) -> None:
  """On a TPU host, libtpu's logs go to ``<workdir>/tpu_logs`` (not /tmp/tpu_logs), unless
  TPU_LOG_DIR is set; a remote workdir keeps libtpu's default. Before JAX starts a backend."""
  if tpu_attached() and "://" not in workdir:
    os.environ.setdefault("TPU_LOG_DIR", os.path.join(os.path.abspath(workdir), "tpu_logs"))


def quiet_without_tpu() -> None:
  """Sets QUIET_ENV's variables not set already, where no TPU is attached."""
  if not tpu_attached():
    for name, value in QUIET_ENV.items():
      os.environ.setdefault(name, value)
