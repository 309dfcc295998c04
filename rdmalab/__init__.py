"""The RDMA lab: a real RDMA stack (Soft-RoCE, the kernel's ``rdma_rxe``) on a machine without an
RDMA device, inside a QEMU guest.

Lifecycle::

    python -m rdmalab setup   apt-get the Debian packages (rdmalab.assets.DEBIAN_PACKAGES, root),
                              then build
    (build, cached)           apt-get download + dpkg-deb -x the Debian kernel (no initramfs
                              step) into .rdmalab/; pick the modules the guest needs and their
                              dependencies (rdmalab.kernel); write a busybox initramfs
                              (rdmalab.initramfs) - rebuilt when an input changes
    python -m rdmalab run -- CMD
      host   qemu-system-x86_64 (TCG by default, -nic none), the host's / shared read-only over
             virtio-9p, a per-run outbox shared read-write (rdmalab.guest.Guest, thread
             rdmalab-console reading the guest's console)
      guest  init (rdmalab/init.sh): insmod the modules (crc32_generic before rdma_rxe), mount
             the host root, tmpfs on /tmp /run /var/tmp /dev/shm, a veth pair with one address
             per end and policy routing so traffic between them crosses the pair, rxe0 on veth0
             and rxe1 on veth1 (rdmalab.network), then chroot and run CMD in the repo; its exit
             status goes to the outbox; power off
      host   the command's exit status and output come back (rdmalab.guest.LabResult); a
             command past its deadline gets the guest killed (LabTimeout)

``pytest -m rdma`` uses it through tests/lab_runner.py. Nothing in the serving packages imports
this package.
"""
