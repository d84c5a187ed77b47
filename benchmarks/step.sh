# Sourced by the GPU session scripts: `step NAME SECONDS COMMAND...` runs COMMAND under a
# timeout with its output in $OUT/NAME.log, prints a one-line verdict (also appended to
# $SUMMARY when set) and sets status=1 when it failed or timed out.
step() {
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    local verdict=ok
    [ $rc -eq 124 ] && verdict="timed out after ${limit}s"
    [ $rc -ne 0 ] && [ $rc -ne 124 ] && verdict="exit $rc"
    [ $rc -ne 0 ] && status=1
    echo "[$((SECONDS - t0))s] $name: $verdict" | tee -a "${SUMMARY:-/dev/null}"
}
