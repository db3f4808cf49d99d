"""slurm-recovery's developer tools: the one-machine Slurm dev cluster that `make
demo` and `make test` run on (``recovery-devcluster``), and the generator of the
configuration and command references in docs/. They use the agent's package;
the agent never imports them, and they are not part of what sites install
(neither the wheel of the product, nor ``make install``, nor the .deb)."""
