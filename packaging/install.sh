#!/bin/sh
# slurm-recovery site install: `make install` and `make uninstall` call this.
#
#   packaging/install.sh install     build the wheel, then install everything
#   packaging/install.sh uninstall   remove what `install` put there
#
# Settings come from the environment (the Makefile sets each one):
#   DESTDIR PREFIX SYSCONFDIR SYSTEMD_UNIT_DIR PLUGSTACK_DIR BINDIR SBINDIR INSTALL_PYTHON
#   SPANK_SO EXTRAS PIP_ARGS BUILD_DIR FORCE COMPILE
#
# The virtualenv is made at a staging path, then its few absolute paths (the
# scripts' #! lines, activate, pyvenv.cfg, the paths compiled into .pyc files)
# are rewritten to $PREFIX, and only then moved into place. So one tree works
# at $PREFIX whatever DESTDIR was, and an upgrade swaps the whole tree at once.
# The tree holds what runs on a site and nothing else: pip and setuptools, which
# only built it, and the commands our dependencies bring (uvicorn, fastapi,
# normalizer, hostlist, ...) are taken out.
# What lands outside $PREFIX is listed in $PREFIX/share/slurm-recovery/install-manifest,
# which `uninstall` reads.
set -eu

SRC=$(cd "$(dirname "$0")/.." && pwd)
: "${DESTDIR:=}" "${PREFIX:=/opt/slurm-recovery}" "${SYSCONFDIR:=/etc}"
: "${SYSTEMD_UNIT_DIR:=/lib/systemd/system}" "${PLUGSTACK_DIR:=/etc/slurm/plugstack.conf.d}"
# where the links that put recovery-ctl and recovery-agent on PATH go
: "${BINDIR:=/usr/local/bin}" "${SBINDIR:=/usr/local/sbin}"
: "${INSTALL_PYTHON:=/usr/bin/python3}" "${SPANK_SO:=$SRC/spank/slurm_recovery.so}"
: "${EXTRAS:=}" "${PIP_ARGS:=}" "${BUILD_DIR:=$SRC/build}" "${FORCE:=}"
# COMPILE=0: no bytecode in the tree (the .deb compiles it in its postinst instead)
: "${COMPILE:=1}"

ROOT=$DESTDIR$PREFIX
MANIFEST_REL=share/slurm-recovery/install-manifest
CONFDIR=$SYSCONFDIR/slurm-recovery
UNITS="slurm-recovery-agent.service slurm-recovery-watchdog.service slurm-recovery-watchdog.timer"
STATE_DIRS="/var/lib/slurm-recovery /var/spool/slurm-recovery /var/log/slurm-recovery"

say() { printf 'slurm-recovery: %s\n' "$*"; }
die() { printf 'slurm-recovery: %s\n' "$*" >&2; exit 1; }
sum() { sha256sum "$1" | cut -d' ' -f1; }
live_systemd() { [ -z "$DESTDIR" ] && [ -d /run/systemd/system ] && command -v systemctl >/dev/null; }

check_prefix() {
    case "$PREFIX" in
        /*) ;;
        *) die "PREFIX must be an absolute path, not '$PREFIX'" ;;
    esac
    case "${PREFIX%/}" in
        ""|/usr|/usr/local|/opt|/etc|/var|/home|/tmp|/srv)
            die "PREFIX=$PREFIX is a system directory; the install owns its PREFIX (use e.g. /opt/slurm-recovery)" ;;
    esac
}

# ---- install ---------------------------------------------------------------

build_wheel() {   # a clean copy of the sources, so no stale build/ or egg-info leaks in
    python=$1
    rm -rf "$BUILD_DIR/src" "$BUILD_DIR/wheel"
    mkdir -p "$BUILD_DIR/src" "$BUILD_DIR/wheel"
    (cd "$SRC" && tar -cf - --exclude=__pycache__ --exclude='*.pyc' \
        pyproject.toml setup.cfg README.md recovery_agent slurm_hooks etc) |
        (cd "$BUILD_DIR/src" && tar -xf -)
    # shellcheck disable=SC2086  # PIP_ARGS is a list of options
    "$python" -m pip wheel -q --no-deps --disable-pip-version-check $PIP_ARGS \
        -w "$BUILD_DIR/wheel" "$BUILD_DIR/src"
    set -- "$BUILD_DIR"/wheel/slurm_recovery-*.whl
    [ -f "$1" ] || die "no wheel was built in $BUILD_DIR/wheel"
    WHEEL=$1
}

relocate() {   # rewrite the staging path to PREFIX in the venv's text files
    stage=$1
    pattern=$(printf '%s' "$stage" | sed 's/[.[\*^$|]/\\&/g')
    for file in "$stage"/bin/* "$stage/pyvenv.cfg"; do
        [ -f "$file" ] && [ ! -L "$file" ] && grep -qIF "$stage" "$file" || continue
        sed -i "s|$pattern|$PREFIX|g" "$file"
    done
    [ "$COMPILE" = 0 ] ||
        "$stage/bin/python" -m compileall -q -f -j 0 -s "$stage" -p "$PREFIX" "$stage/lib" \
            >"$BUILD_DIR/compileall.log" 2>&1 ||
        say "note: some files did not byte-compile (see $BUILD_DIR/compileall.log)"
    left=$(grep -rlIF --exclude='*.pyc' "$stage" "$stage" || true)
    [ -z "$left" ] || die "staging path left in: $left"
}

prune() {   # what only built the tree, and commands that are not ours
    stage=$1
    "$stage/bin/python" -m pip uninstall -q -y --disable-pip-version-check pip setuptools wheel \
        >"$BUILD_DIR/prune.log" 2>&1 || { cat "$BUILD_DIR/prune.log" >&2; die "pip uninstall failed"; }
    set -- "$stage"/lib/python3*/site-packages/slurm_recovery-*.dist-info/entry_points.txt
    [ -f "$1" ] || die "no entry_points.txt in the installed slurm-recovery"
    ours=$(sed -n '/^\[console_scripts\]/,/^\[/s/^\([A-Za-z0-9_.-]*\) *=.*/\1/p' "$1" | tr '\n' ' ')
    [ -n "$ours" ] || die "no console_scripts in $1"
    for file in "$stage"/bin/*; do
        name=${file##*/}
        case " $ours" in *" $name "*) continue ;; esac
        case "$name" in
            python|python3|python3.*|activate|activate.*|Activate.ps1) ;;   # the venv's own
            *) rm -f "$file" ;;
        esac
    done
    rm -rf "$stage/share/man"   # the pages of those commands (python-hostlist's)
}

make_tree() {   # the whole PREFIX tree, at a staging path
    stage=$1
    "$INSTALL_PYTHON" -m venv "$stage"
    build_wheel "$stage/bin/python"
    # shellcheck disable=SC2086
    "$stage/bin/python" -m pip install -q --no-compile --disable-pip-version-check $PIP_ARGS \
        "$WHEEL${EXTRAS:+[$EXTRAS]}"
    [ -d "$stage/share/slurm-recovery/patterns" ] ||
        die "the wheel did not install the pattern packs (pyproject data-files)"
    prune "$stage"
    relocate "$stage"
    install -D -m 0755 "$SPANK_SO" "$stage/lib/slurm-recovery/slurm_recovery.so"
    install -d "$stage/libexec" "$stage/share/doc/slurm-recovery/docs"
    for tmpl in "$SRC"/packaging/libexec/*.in; do
        out=$stage/libexec/$(basename "$tmpl" .in)
        sed -e "s|@PREFIX@|$PREFIX|g" -e "s|@CONFDIR@|$CONFDIR|g" "$tmpl" >"$out"
        chmod 0755 "$out"
    done
    install -m 0644 "$SRC/README.md" "$stage/share/doc/slurm-recovery/"
    install -m 0644 "$SRC"/docs/*.md "$SRC"/docs/*.png "$stage/share/doc/slurm-recovery/docs/"
    install -m 0644 "$SRC/etc/recovery.toml" "$stage/share/doc/slurm-recovery/recovery.toml.example"
    sed -e "s|@PREFIX@|$PREFIX|g" "$SRC/packaging/slurm-recovery.plugstack.conf" \
        >"$stage/share/slurm-recovery/plugstack.conf"
}

# manifest lines: "file PATH", "dir PATH", "conf PATH SHA256" (removed only while
# unchanged), "snippet PATH SHA256" (the plugstack line: moved aside when changed,
# since it names the plugin that uninstall removes)
NEW_MANIFEST=
OLD_MANIFEST=
record() { NEW_MANIFEST=$NEW_MANIFEST$*'
'; }
old_sum() { printf '%s' "$OLD_MANIFEST" | awk -v p="$1" 'NF == 3 && $2 == p { print $3 }'; }

make_dir() {   # mkdir -p, recording each directory it creates
    [ -d "$DESTDIR$1" ] && return 0
    [ "$1" != / ] || { mkdir -p "$DESTDIR"; return 0; }
    make_dir "$(dirname "$1")"
    install -d -m 0755 "$DESTDIR$1"
    record dir "$1"
}

install_conf() {   # KIND SRC DEST: never overwrite an admin's file; the new one goes beside it as .dist
    kind=$1 src=$2 dest=$3 target=$DESTDIR$3 new=$(sum "$2")
    make_dir "$(dirname "$dest")"
    if [ ! -e "$target" ]; then
        install -m 0644 "$src" "$target"
        record "$kind" "$dest" "$new"
        return
    fi
    cur=$(sum "$target") prev=$(old_sum "$dest")
    if [ "$cur" = "$new" ]; then
        [ -z "$prev" ] || record "$kind" "$dest" "$new"
    elif [ -n "$prev" ] && [ "$cur" = "$prev" ]; then   # ours and unchanged: update it
        install -m 0644 "$src" "$target"
        record "$kind" "$dest" "$new"
    else
        install -m 0644 "$src" "$target.dist"
        record file "$dest.dist"
        [ -z "$prev" ] || record "$kind" "$dest" "$prev"
        say "kept your $dest; the shipped version is $dest.dist"
    fi
}

link_command() {   # DIR NAME: DIR/NAME -> PREFIX/bin/NAME, unless DIR/NAME is someone else's
    make_dir "$1"
    link=$DESTDIR$1/$2
    if { [ -e "$link" ] || [ -L "$link" ]; } && [ "$(readlink "$link")" != "$PREFIX/bin/$2" ]; then
        say "kept $1/$2, which is not our link to $PREFIX/bin/$2"
        return
    fi
    ln -sfn "$PREFIX/bin/$2" "$link"
    record file "$1/$2"
}

install_outside() {
    tmp=$BUILD_DIR/outside
    rm -rf "$tmp" && mkdir -p "$tmp"
    make_dir "$SYSTEMD_UNIT_DIR"
    for unit in $UNITS; do
        sed -e "s|/opt/slurm-recovery|$PREFIX|g" -e "s|/etc/slurm-recovery|$CONFDIR|g" \
            "$SRC/contrib/systemd/$unit" >"$tmp/$unit"
        install -m 0644 "$tmp/$unit" "$DESTDIR$SYSTEMD_UNIT_DIR/$unit"
        record file "$SYSTEMD_UNIT_DIR/$unit"
    done
    link_command "$BINDIR" recovery-ctl
    link_command "$SBINDIR" recovery-agent
    install_conf conf "$SRC/etc/recovery.toml" "$CONFDIR/recovery.toml"
    install_conf snippet "$1/share/slurm-recovery/plugstack.conf" "$PLUGSTACK_DIR/slurm-recovery.conf"
}

write_manifest() {   # this install's lines, then the previous install's not superseded
    printf '%s' "$NEW_MANIFEST" >"$BUILD_DIR/manifest.new"
    printf '%s\n' "$OLD_MANIFEST" >"$BUILD_DIR/manifest.old"
    {
        echo "# written by slurm-recovery's make install; read by make uninstall"
        awk 'NR == FNR { seen[$2] = 1; print; next }
             NF && $1 !~ /^#/ && !($2 in seen)' "$BUILD_DIR/manifest.new" "$BUILD_DIR/manifest.old"
    } >"$ROOT/$MANIFEST_REL"
}

stop_units() {   # print the units that were active, having stopped them
    live_systemd || return 0
    for unit in slurm-recovery-agent.service slurm-recovery-watchdog.timer; do
        if systemctl -q is-active "$unit" 2>/dev/null; then
            systemctl stop "$unit" >&2 && echo "$unit"
        fi
    done
}

deb_installed() {
    [ -z "$DESTDIR" ] && dpkg-query -W -f='${Status}' slurm-recovery 2>/dev/null |
        grep -q ' installed$'
}

do_install() {
    check_prefix
    [ -f "$SPANK_SO" ] || die "no SPANK plugin at $SPANK_SO (make -C spank)"
    ! deb_installed || die "the Debian package is installed: install a newer .deb (make deb) instead"
    if [ -e "$ROOT" ] && [ ! -f "$ROOT/$MANIFEST_REL" ] && [ ! -f "$ROOT/pyvenv.cfg" ]; then
        die "$ROOT exists and is not a slurm-recovery install; choose another PREFIX"
    fi
    [ ! -f "$ROOT/$MANIFEST_REL" ] || OLD_MANIFEST=$(cat "$ROOT/$MANIFEST_REL")
    stage=$ROOT.new-$$
    trap 'rm -rf "$stage" "$ROOT.old-$$"' EXIT
    make_dir "$(dirname "$PREFIX")"
    make_tree "$stage"
    install_outside "$stage"
    stopped=$(stop_units)
    if [ -e "$ROOT" ]; then mv "$ROOT" "$ROOT.old-$$"; fi
    mv "$stage" "$ROOT"
    write_manifest
    if [ -z "$DESTDIR" ]; then
        ! live_systemd || systemctl daemon-reload
        "$ROOT/libexec/store-upgrade"
        for unit in $stopped; do systemctl start "$unit"; done
    fi
    say "installed into ${DESTDIR:+$DESTDIR and }$PREFIX"
    [ -n "$DESTDIR" ] || cat <<EOF
next steps (docs: $PREFIX/share/doc/slurm-recovery/docs/install.md):
  edit $CONFDIR/recovery.toml (cluster, api.bind, hooks.agent_url)
  slurm.conf: Prolog=$PREFIX/libexec/prolog.sh  Epilog=$PREFIX/libexec/epilog.sh
              HealthCheckProgram=$PREFIX/libexec/healthcheck.sh  PrologFlags=Alloc
  agent host: systemctl enable --now slurm-recovery-agent slurm-recovery-watchdog.timer
EOF
}

# ---- uninstall -------------------------------------------------------------

hooks_in_slurm_conf() {
    conf=${SLURM_CONF:-/etc/slurm/slurm.conf}
    [ -f "$conf" ] || return 1
    grep -E "^[[:space:]]*(Prolog|Epilog|HealthCheckProgram)[[:space:]]*=[[:space:]]*$PREFIX/" "$conf"
}

do_uninstall() {
    check_prefix
    manifest=$ROOT/$MANIFEST_REL
    [ -f "$manifest" ] || die "no $manifest: make install put nothing at $PREFIX"
    ! deb_installed || die "the Debian package owns this install: apt remove slurm-recovery"
    if [ -z "$DESTDIR" ] && [ -z "$FORCE" ] && lines=$(hooks_in_slurm_conf); then
        die "slurm.conf still runs hooks from $PREFIX, and a missing Prolog or Epilog drains
the node. Remove these lines, run scontrol reconfigure, then uninstall (or FORCE=1):
$lines"
    fi
    if [ -z "$DESTDIR" ] && command -v systemctl >/dev/null; then
        if live_systemd; then
            systemctl disable --now $UNITS 2>/dev/null || true
        else
            systemctl --no-reload disable $UNITS 2>/dev/null || true
        fi
    fi
    kept=
    dirs=
    while read -r kind path hash; do
        target=$DESTDIR$path
        case "$kind" in
            file) rm -f "$target" ;;
            conf|snippet)
                if [ ! -e "$target" ]; then :
                elif [ "$(sum "$target")" = "$hash" ]; then rm -f "$target"
                elif [ "$kind" = conf ]; then kept="$kept  $path (changed since install)
"
                else
                    mkdir -p "$DESTDIR$CONFDIR"
                    mv "$target" "$DESTDIR$CONFDIR/plugstack.conf.saved"
                    kept="$kept  $CONFDIR/plugstack.conf.saved (your changed $path, moved: it named the plugin removed now)
"
                fi ;;
            dir) dirs="$path $dirs" ;;
        esac
    done <"$manifest"
    rm -rf "$ROOT"
    for dir in $dirs; do   # newest first: children before their parents
        rmdir "$DESTDIR$dir" 2>/dev/null && continue
        case "$kept" in
            *"  $dir/"*) ;;   # it holds a file already listed
            *) kept="$kept  $dir/ (holds files install did not put there)
" ;;
        esac
    done
    ! live_systemd || systemctl daemon-reload
    say "removed $PREFIX and the files make install put outside it"
    for dir in $STATE_DIRS; do
        [ ! -e "$DESTDIR$dir" ] || kept="$kept  $dir/ (state: store, spool or logs)
"
    done
    if [ -n "$kept" ]; then
        say "left behind (remove by hand if you no longer need them):"
        printf '%s' "$kept"
    fi
}

case "${1:-}" in
    install) do_install ;;
    uninstall) do_uninstall ;;
    *) die "usage: $0 install|uninstall" ;;
esac
