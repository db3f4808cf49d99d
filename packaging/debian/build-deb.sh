#!/bin/sh
# Turn a `make install DESTDIR=ROOT` tree into a Debian package with dpkg-deb.
#
#   packaging/debian/build-deb.sh ROOT OUT.deb
#
# Environment (from the Makefile): PREFIX SYSCONFDIR PLUGSTACK_DIR VERSION ARCH.
# Depends are read off what was built: the virtualenv's Python series, the
# Slurm series the SPANK plugin was compiled against (a SPANK plugin loads
# only into the Slurm release it was built for), the newest glibc symbol
# version any shared object in the tree needs.
set -eu
root=$1 out=$2
here=$(cd "$(dirname "$0")" && pwd)

next_series() { echo "$1" | awk -F. '{ printf "%d.%02d\n", $1, $2 + 1 }'; }

py=$("$root$PREFIX/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
hex=$(sed -n 's/^#define SLURM_VERSION_NUMBER 0x\([0-9a-fA-F]*\).*/\1/p' \
    /usr/include/slurm/slurm_version.h)
[ -n "$hex" ] || { echo "build-deb: no SLURM_VERSION_NUMBER in slurm_version.h" >&2; exit 1; }
slurm=$(printf '%d.%02d' "0x${hex%????}" "0x$(echo "$hex" | cut -c3-4)")
glibc=$(find "$root" -type f -name '*.so*' -exec objdump -T {} + 2>/dev/null |
    grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -n 1)
py_next=$(echo "$py" | awk -F. '{ printf "%d.%d\n", $1, $2 + 1 }')
depends="python3 (>= $py), python3 (<< $py_next), libc6 (>= ${glibc:-2.17}), munge,"
depends="$depends slurm-wlm-basic-plugins (>= $slurm), slurm-wlm-basic-plugins (<< $(next_series "$slurm")),"
depends="$depends slurm-client | slurmd"

rm -f "$root$PREFIX/share/slurm-recovery/install-manifest"   # dpkg keeps the file list
# The plugstack line is not a conffile: a conffile outlives `apt remove`, and a
# line naming a removed plugin makes every sbatch and srun print errors. The
# maintainer scripts put it in place and take it away (postinst, prerm).
rm -f "$root$PLUGSTACK_DIR/slurm-recovery.conf"
rmdir -p "$root$PLUGSTACK_DIR" 2>/dev/null || true
install -d "$root/DEBIAN" "$root/usr/share/doc/slurm-recovery"
install -m 0644 "$here/copyright" "$root/usr/share/doc/slurm-recovery/copyright"
size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
sed -e "s|@VERSION@|$VERSION|" -e "s|@ARCH@|$ARCH|" -e "s|@SIZE@|$size|" \
    -e "s#@DEPENDS@#$depends#" -e "s|@PREFIX@|$PREFIX|g" "$here/control.in" >"$root/DEBIAN/control"
echo "$SYSCONFDIR/slurm-recovery/recovery.toml" >"$root/DEBIAN/conffiles"
for script in postinst prerm postrm; do
    sed -e "s|@PREFIX@|$PREFIX|g" -e "s|@CONFDIR@|$SYSCONFDIR/slurm-recovery|g" \
        -e "s|@PLUGSTACK_DIR@|$PLUGSTACK_DIR|g" "$here/$script.in" >"$root/DEBIAN/$script"
    chmod 0755 "$root/DEBIAN/$script"
done
(cd "$root" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' |
    LC_ALL=C sort -z | xargs -0 md5sum) >"$root/DEBIAN/md5sums"
mkdir -p "$(dirname "$out")"
dpkg-deb --root-owner-group -Zxz --build "$root" "$out" >/dev/null
echo "built $out"
