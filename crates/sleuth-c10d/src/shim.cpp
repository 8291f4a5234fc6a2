// The C face of torch.distributed's engine (c10d) for Rust: a TCPStore for
// rendezvous and small messages, and a process group (Gloo for CPU tensors,
// NCCL for CUDA tensors) for the collectives sharded training needs.
//
// Every call returns NULL on success or a malloc'd message (freed with
// sleuth_c10d_free_error): c10d reports failures as C++ exceptions, which
// must not cross into Rust. Tensors are tch's (`at::Tensor*`, as torch-sys's
// own wrapper defines them).

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

struct Group {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
  std::chrono::milliseconds timeout;
};

char* error(const std::string& message) {
  return strdup(message.c_str());
}

// Runs `body`, turning any exception into the message Rust receives.
template <typename F>
char* guarded(F body) {
  try {
    body();
    return nullptr;
  } catch (const std::exception& e) {
    return error(e.what());
  } catch (...) {
    return error("unknown C++ exception");
  }
}

// The group's backend; none after sleuth_c10d_abort.
c10d::Backend* backend(Group* g) {
  if (!g->backend) {
    throw std::runtime_error("the process group was aborted after an earlier collective failed");
  }
  return g->backend.get();
}

void finish(Group* g, const c10::intrusive_ptr<c10d::Work>& work) {
  if (!work->wait(g->timeout)) {
    throw std::runtime_error("the collective did not complete within the timeout");
  }
}

// The element-wise sum over ranks of `input` (world x output's elements),
// this rank's chunk into `output`, as a ring of sends and receives: in step
// s every rank sends the partial sum of one chunk to the next rank and adds
// what the previous rank sent to its own part of the chunk it will send in
// step s + 1; after world - 1 steps the partial sum a rank holds is its own
// chunk, complete. Each rank sends (world - 1) / world of the input once,
// the bound of a reduce-scatter. Gloo's own _reduce_scatter_base is an
// all-reduce followed by a copy of the chunk, half as many bytes again.
// `input` is only read; the partial sums live in two chunk-sized buffers.
void ring_reduce_scatter(Group* g, at::Tensor& output, const at::Tensor& input) {
  const int rank = backend(g)->getRank();
  const int world = backend(g)->getSize();
  const int64_t chunk = output.numel();
  const auto flat = input.reshape({-1});
  auto part = [&](int index) { return flat.narrow(0, int64_t((index % world + world) % world) * chunk, chunk); };
  if (world == 1) {
    output.copy_(flat);
    return;
  }
  const int next = (rank + 1) % world;
  const int previous = (rank + world - 1) % world;
  at::Tensor received = at::empty({chunk}, output.options());
  at::Tensor sum = at::empty({chunk}, output.options());
  at::Tensor carry = part(rank - 1);
  for (int step = 0; step < world - 1; ++step) {
    std::vector<at::Tensor> outgoing{carry};
    std::vector<at::Tensor> incoming{received};
    auto sent = backend(g)->send(outgoing, next, step);
    auto got = backend(g)->recv(incoming, previous, step);
    finish(g, got);
    finish(g, sent);
    // What came in is the previous rank's partial sum of this chunk.
    const auto mine = part(rank - step - 2);
    if (step == world - 2) {
      at::add_out(output, mine, received);
    } else {
      at::add_out(sum, mine, received);
      carry = sum;
    }
  }
}

}  // namespace

#ifdef SLEUTH_C10D_NCCL
// Defined in nccl.cpp, which includes CUDA's headers (only where they exist).
c10::intrusive_ptr<c10d::Backend> sleuth_c10d_nccl(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int world, std::chrono::milliseconds timeout);
#endif

extern "C" {

typedef struct Group sleuth_c10d_group;

void sleuth_c10d_free_error(char* message) {
  free(message);
}

void sleuth_c10d_free_bytes(uint8_t* bytes) {
  free(bytes);
}

// Joins (rank 0: hosts) the TCPStore at host:port. The process group is made
// separately (sleuth_c10d_start), once every rank has been seen in the store.
char* sleuth_c10d_store(const char* host, uint16_t port, int rank, int world, int64_t timeout_ms,
                        sleuth_c10d_group** out) {
  return guarded([&] {
    c10d::TCPStoreOptions options;
    options.port = port;
    options.isServer = rank == 0;
    options.numWorkers = world;
    options.waitWorkers = false;
    options.timeout = std::chrono::milliseconds(timeout_ms);
    auto group = new Group();
    group->store = c10::make_intrusive<c10d::TCPStore>(std::string(host), options);
    group->timeout = std::chrono::milliseconds(timeout_ms);
    *out = group;
  });
}

// Starts the process group: `nccl` 0 is Gloo, bound to `interface` when not
// empty, else to `bind_host` when not empty, else where this host's name
// resolves (c10d's default); 1 is NCCL.
char* sleuth_c10d_start(sleuth_c10d_group* g, int rank, int world, int64_t timeout_ms, int nccl,
                        const char* interface, const char* bind_host) {
  return guarded([&] {
    auto timeout = std::chrono::milliseconds(timeout_ms);
    g->timeout = timeout;
    if (nccl) {
#ifdef SLEUTH_C10D_NCCL
      g->backend = sleuth_c10d_nccl(g->store, rank, world, timeout);
#else
      throw std::runtime_error(
          "this build has no NCCL backend (libtorch_cuda or CUDA's headers were missing when it was built)");
#endif
      return;
    }
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    if (interface != nullptr && interface[0] != '\0') {
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(interface));
    } else if (bind_host != nullptr && bind_host[0] != '\0') {
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(bind_host));
    } else {
      options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
    g->backend = c10::make_intrusive<c10d::ProcessGroupGloo>(g->store, rank, world, options);
  });
}

// Ends the process group's part in every collective: NCCL aborts its
// communicators; Gloo's connections close when the backend goes. A peer
// blocked on this rank (a ring step waiting for what this rank will never
// send) then fails at once instead of at the timeout. The store stays, for
// the roll call after the failure.
char* sleuth_c10d_abort(sleuth_c10d_group* g) {
  return guarded([&] {
    if (g->backend) {
      g->backend->abort();
      g->backend.reset();
    }
  });
}

void sleuth_c10d_free_group(sleuth_c10d_group* g) {
  delete g;
}

// output: world x input's elements, rank order.
char* sleuth_c10d_all_gather(sleuth_c10d_group* g, at::Tensor* output, at::Tensor* input) {
  return guarded([&] { finish(g, backend(g)->_allgather_base(*output, *input)); });
}

// The element-wise sum over ranks of `input` (world x output's elements),
// this rank's chunk into `output`: NCCL's own reduce-scatter, a ring of
// sends and receives through Gloo.
char* sleuth_c10d_reduce_scatter(sleuth_c10d_group* g, at::Tensor* output, at::Tensor* input) {
  return guarded([&] {
    if (dynamic_cast<c10d::ProcessGroupGloo*>(backend(g)) != nullptr) {
      ring_reduce_scatter(g, *output, *input);
    } else {
      finish(g, backend(g)->_reduce_scatter_base(*output, *input));
    }
  });
}

// op: 0 sum, 1 max.
char* sleuth_c10d_all_reduce(sleuth_c10d_group* g, at::Tensor* tensor, int op) {
  return guarded([&] {
    std::vector<at::Tensor> tensors{*tensor};
    c10d::AllreduceOptions options;
    options.reduceOp = op == 1 ? c10d::ReduceOp(c10d::ReduceOp::MAX) : c10d::ReduceOp(c10d::ReduceOp::SUM);
    finish(g, backend(g)->allreduce(tensors, options));
  });
}

char* sleuth_c10d_broadcast(sleuth_c10d_group* g, at::Tensor* tensor, int root) {
  return guarded([&] {
    std::vector<at::Tensor> tensors{*tensor};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    finish(g, backend(g)->broadcast(tensors, options));
  });
}

char* sleuth_c10d_barrier(sleuth_c10d_group* g) {
  return guarded([&] { finish(g, backend(g)->barrier()); });
}

char* sleuth_c10d_store_set(sleuth_c10d_group* g, const char* key, const uint8_t* data, size_t len) {
  return guarded([&] { g->store->set(key, std::vector<uint8_t>(data, data + len)); });
}

// *present: whether `key` is in the store now (never waits).
char* sleuth_c10d_store_check(sleuth_c10d_group* g, const char* key, int* present) {
  return guarded([&] { *present = g->store->check({std::string(key)}) ? 1 : 0; });
}

// The value of `key`, which must be present; *data is freed with sleuth_c10d_free_bytes.
char* sleuth_c10d_store_get(sleuth_c10d_group* g, const char* key, uint8_t** data, size_t* len) {
  return guarded([&] {
    auto value = g->store->get(key);
    *len = value.size();
    *data = static_cast<uint8_t*>(malloc(value.size() == 0 ? 1 : value.size()));
    if (*data == nullptr) throw std::bad_alloc();
    if (!value.empty()) memcpy(*data, value.data(), value.size());
  });
}

// Adds `delta` to the counter `key` (0 if absent); *value: the new count.
char* sleuth_c10d_store_add(sleuth_c10d_group* g, const char* key, int64_t delta, int64_t* value) {
  return guarded([&] { *value = g->store->add(key, delta); });
}

char* sleuth_c10d_store_delete(sleuth_c10d_group* g, const char* key) {
  return guarded([&] { g->store->deleteKey(key); });
}

}  // extern "C"
