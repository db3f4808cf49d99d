#!/bin/sh
# Turn a `make install DESTDIR=ROOT COMPILE=0` tree into a Debian package with dpkg-deb.
#
#   packaging/debian/build-deb.sh ROOT OUT.deb
#
# Environment (from the Makefile): PREFIX SYSCONFDIR PLUGSTACK_DIR VERSION ARCH.
# VERSION is pyproject.toml's; the package's version is the top entry of
# packaging/debian/changelog, which must be VERSION plus a Debian revision
# (0.1.0-1): a new upstream version needs a changelog entry first.
# Depends are read off what was built: the virtualenv's Python series, the
# Slurm series the SPANK plugin was compiled against (a SPANK plugin loads
# only into the Slurm release it was built for), the newest glibc symbol
# version any shared object in the tree needs.
set -eu
root=$1 out=$2
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../.." && pwd)
die() { printf 'build-deb: %s\n' "$*" >&2; exit 1; }

next_series() { echo "$1" | awk -F. '{ printf "%d.%02d\n", $1, $2 + 1 }'; }

# ---- the version and the maintainer: the changelog and pyproject.toml --------
changelog=$here/changelog
deb_version=$(sed -n '1s/^slurm-recovery (\([^)]*\)) .*/\1/p' "$changelog")
case "$deb_version" in
    "$VERSION"-[0-9]*) ;;
    *) die "the top entry of $changelog is '$deb_version'; pyproject.toml's version is" \
           "$VERSION: add an entry '$VERSION-1' (a Debian revision is required)" ;;
esac
maintainer=$(python3 -c 'import sys, tomllib
author = tomllib.load(open(sys.argv[1], "rb"))["project"]["authors"][0]
print("%s <%s>" % (author["name"], author["email"]))' "$src/pyproject.toml")
trailer=$(sed -n 's/^ -- \(.*>\)  .*/\1/p' "$changelog" | head -n 1)
[ "$trailer" = "$maintainer" ] ||
    die "the changelog's top entry is signed '$trailer', pyproject.toml's author is '$maintainer'"
date=$(sed -n 's/^ -- .*>  \(.*\)$/\1/p' "$changelog" | head -n 1)
date=$(date -u -d "$date" +%Y-%m-%d) || die "the changelog's top entry has no valid date"

# ---- what the tree must not hold ---------------------------------------------
rm -f "$root$PREFIX/share/slurm-recovery/install-manifest"   # dpkg keeps the file list
# The plugstack line is not a conffile: a conffile outlives `apt remove`, and a
# line naming a removed plugin makes every sbatch and srun print errors. The
# maintainer scripts put it in place and take it away (postinst, prerm).
rm -f "$root$PLUGSTACK_DIR/slurm-recovery.conf"
rmdir -p "$root$PLUGSTACK_DIR" 2>/dev/null || true
# bytecode is the postinst's to make and the prerm's to remove: none in the .deb
find "$root" -depth -name __pycache__ -type d -exec rm -rf {} +
find "$root" -name '*.py[co]' -type f -delete

py=$("$root$PREFIX/bin/python" -B -c 'import sys; print("%d.%d" % sys.version_info[:2])')
hex=$(sed -n 's/^#define SLURM_VERSION_NUMBER 0x\([0-9a-fA-F]*\).*/\1/p' \
    /usr/include/slurm/slurm_version.h)
[ -n "$hex" ] || die "no SLURM_VERSION_NUMBER in slurm_version.h"
slurm=$(printf '%d.%02d' "0x${hex%????}" "0x$(echo "$hex" | cut -c3-4)")

# ---- strip what is built unstripped (dh_strip's options) ---------------------
# Our SPANK plugin, and the few extension modules in third-party wheels that come
# with their symbol tables (psutil, charset_normalizer). Libraries a wheel vendors
# in a *.libs directory were rewritten by auditwheel (patchelf): those are left as
# they are, since strip can break a patchelf'ed file, and they come stripped.
# Every extension module stripped here is imported again afterwards.
stripped=
for so in $(find "$root" -type f -name '*.so*' ! -path '*.libs/*' | LC_ALL=C sort); do
    readelf -S -W "$so" 2>/dev/null | grep -q '[[:space:]]\.symtab[[:space:]]' || continue
    strip --strip-unneeded --remove-section=.comment --remove-section=.note "$so"
    stripped="$stripped $so"
done
site=$(echo "$root$PREFIX"/lib/python3*/site-packages)
for so in $stripped; do
    case "$so" in "$site"/*) ;; *) continue ;; esac
    module=$(echo "${so#"$site"/}" | sed 's/\.[^/]*$//; s|/|.|g')
    "$root$PREFIX/bin/python" -B -c "import $module" ||
        die "$module does not import after strip"
done
glibc=$(find "$root" -type f -name '*.so*' -exec objdump -T {} + 2>/dev/null |
    grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -n 1)

py_next=$(echo "$py" | awk -F. '{ printf "%d.%d\n", $1, $2 + 1 }')
depends="python3 (>= $py), python3 (<< $py_next), libc6 (>= ${glibc:-2.17}), munge,"
depends="$depends slurm-wlm-basic-plugins (>= $slurm), slurm-wlm-basic-plugins (<< $(next_series "$slurm")),"
depends="$depends slurm-client | slurmd"

# ---- on PATH, with manual pages ------------------------------------------------
doc=$root/usr/share/doc/slurm-recovery
# make install made the links (the Makefile's deb target: BINDIR=/usr/bin SBINDIR=/usr/sbin)
for link in usr/bin/recovery-ctl usr/sbin/recovery-agent; do
    [ "$(readlink "$root/$link")" = "$PREFIX/bin/${link##*/}" ] ||
        die "no /$link -> $PREFIX/bin/${link##*/} in the tree (make deb sets BINDIR and SBINDIR)"
done
install -d "$root/usr/share/man/man1" "$root/usr/share/man/man8" "$doc" \
    "$root/usr/share/lintian/overrides"
manpage() {   # NAME MODULE:ATTR SECTION SUMMARY
    "$root$PREFIX/bin/python" -B "$here/manpage.py" "$1" "$2" "$3" "$VERSION" "$date" "$4" |
        gzip -9n >"$root/usr/share/man/man$3/$1.$3.gz"
}
manpage recovery-ctl recovery_agent.interfaces.ctl:main 1 \
    "inspect and steer slurm-recovery: jobs, nodes, recommendations, modes, audit"
manpage recovery-agent recovery_agent.agent:main 8 \
    "the slurm-recovery agent: hook reports in, recovery decisions out"
[ -z "$(find "$root" -name __pycache__)" ] || die "bytecode written into the tree while building"

install -m 0644 "$here/copyright" "$doc/copyright"
gzip -9n <"$changelog" >"$doc/changelog.Debian.gz"
chmod 0644 "$doc/changelog.Debian.gz" "$root"/usr/share/man/man*/*.gz
install -m 0644 "$here/lintian-overrides" "$root/usr/share/lintian/overrides/slurm-recovery"

# ---- the control files ---------------------------------------------------------
install -d "$root/DEBIAN"
size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
sed -e "s|@VERSION@|$deb_version|" -e "s|@ARCH@|$ARCH|" -e "s|@SIZE@|$size|" \
    -e "s#@DEPENDS@#$depends#" -e "s|@PREFIX@|$PREFIX|g" -e "s|@MAINTAINER@|$maintainer|" \
    "$here/control.in" >"$root/DEBIAN/control"
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
