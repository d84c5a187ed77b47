# Sourced by the benchmark scripts: start the MPS control daemon when this machine has one
# and we are root (several PEs then share the GPU's SMs instead of time-slicing it), and stop
# it when the script exits. Needs OUT (the run's folder) and LOG (its log file).
MPS=0
if command -v nvidia-cuda-mps-control >/dev/null && [ "$(id -u)" = 0 ]; then
    export CUDA_MPS_PIPE_DIRECTORY="$OUT/mps-pipe" CUDA_MPS_LOG_DIRECTORY="$OUT/mps-log"
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if timeout 30 nvidia-cuda-mps-control -d; then MPS=1; echo "MPS started" | tee -a "$LOG"; fi
else
    echo "MPS not started (no nvidia-cuda-mps-control or not root): PEs time-slice the GPU" | tee -a "$LOG"
fi
stop_mps() {
    if [ "$MPS" = 1 ]; then
        echo quit | timeout 30 nvidia-cuda-mps-control && echo "MPS stopped" | tee -a "$LOG"
        MPS=0
    fi
}
trap stop_mps EXIT
