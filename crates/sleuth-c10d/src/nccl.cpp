// ProcessGroupNCCL, in a file of its own: its header needs CUDA's and NCCL's
// headers, which the build finds in the venv's nvidia packages only where
// torch is a CUDA build (build.rs compiles this file only then).

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

c10::intrusive_ptr<c10d::Backend> sleuth_c10d_nccl(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int world, std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world, options);
}
