// TEST-ONLY: a kernel that traps, for proving that a sticky device error
// (CUDA_ERROR_LAUNCH_FAILED on every later call) makes the server exit so that
// its supervisor restarts it. Launched only when SPARKD_TEST_DEVICE_FAULT=1.
__global__ void trap_kernel() { __trap(); }
