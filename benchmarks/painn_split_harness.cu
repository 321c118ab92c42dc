// A harness for cuda/painn_split.cu alone (no torch), built and run by painn_split_phases.py:
// the benchmark student's sizes on benzene (12 atoms, every one of the 132 pairs; 128 features,
// 20 basis functions, 3 interactions) with random weights. It prints the kernel's time a call in
// CUDA graphs of 20 calls (the median of 200 replays), the energy and the gradient's norm, and
// writes the gradient to argv[1] (so that variants of the kernel can be compared). Built with
// MIRAGE_PHASES from a copy of the kernel that stamps %globaltimer in block 0 (the script makes
// it), it also prints the mean time from each stamp to the next over 200 single calls.
#include KERNEL_SOURCE

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

using namespace mirage::cuda;

namespace {

#define CHECK(call)                                                        \
  do {                                                                     \
    const cudaError_t error = (call);                                      \
    if (error != cudaSuccess) {                                            \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(error)); \
      std::exit(1);                                                        \
    }                                                                      \
  } while (0)

std::mt19937 generator(0);

template <typename T>
T* upload(const std::vector<T>& values) {
  T* device = nullptr;
  CHECK(cudaMalloc(&device, values.size() * sizeof(T)));
  CHECK(cudaMemcpy(device, values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice));
  return device;
}

// n normal floats of standard deviation `scale` (nn.Linear's weights: about 1 / sqrt(inputs)).
const float* random_floats(size_t n, float scale) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> values(n);
  for (float& v : values) v = normal(generator);
  return upload(values);
}

void launch(const PainnEnergyParams& p, cudaStream_t stream) {
  const std::optional<cudaError_t> status = try_launch_painn_split(p, stream);
  if (!status) {
    std::fprintf(stderr, "the split kernel does not take these sizes on this device\n");
    std::exit(1);
  }
  CHECK(*status);
}

}  // namespace

int main(int argc, char** argv) {
  const int N = 12, F = 128, H = 128, K = 128, Kr = 64, R = 20, T = 3;
  // A planar ring of radius 1.4 (every pair within the 5.0 cutoff), alternate atoms raised.
  std::vector<float> positions(3 * N);
  for (int a = 0; a < N; ++a) {
    positions[3 * a] = 1.4f * std::cos(a * 0.5236f);
    positions[3 * a + 1] = 1.4f * std::sin(a * 0.5236f);
    positions[3 * a + 2] = (a % 2) * 0.3f;
  }
  std::vector<int64_t> receivers, senders;
  for (int i = 0; i < N; ++i)
    for (int j = 0; j < N; ++j)
      if (i != j) receivers.push_back(i), senders.push_back(j);
  const int P = static_cast<int>(receivers.size());
  std::vector<int64_t> pairs(receivers);
  pairs.insert(pairs.end(), senders.begin(), senders.end());
  std::vector<float> vectors(3 * P);
  for (int e = 0; e < P; ++e)
    for (int c = 0; c < 3; ++c) vectors[3 * e + c] = positions[3 * senders[e] + c] - positions[3 * receivers[e] + c];
  std::vector<int64_t> atomic_numbers(N);
  for (int a = 0; a < N; ++a) atomic_numbers[a] = a % 2;

  PainnEnergyParams p{};
  p.atomic_numbers = upload(atomic_numbers);
  p.pairs = upload(pairs);
  p.vectors = upload(vectors);
  p.embedding = random_floats(10 * F, 1.0f);
  CHECK(cudaMalloc(&p.energy, sizeof(float)));
  CHECK(cudaMalloc(&p.grad_vectors, 3 * P * sizeof(float)));
  CHECK(cudaMalloc(&p.grad_positions, 3 * N * sizeof(float)));
  p.num_atoms = N;
  p.num_pairs = P;
  p.num_embeddings = 10;
  p.num_rbf = R;
  p.features = F;
  p.phi_hidden = H;
  p.update_hidden = K;
  p.readout_hidden = Kr;
  p.num_interactions = T;
  p.cutoff = 5.0f;
  p.norm_eps = 1e-8f;
  p.readout_activation = Activation::kSilu;
  for (int t = 0; t < T; ++t) {
    PainnInteraction& layer = p.interactions[t];
    layer.phi1_w = random_floats(H * F, 0.09f);
    layer.phi1_b = random_floats(H, 0.3f);
    layer.phi2_w = random_floats(3 * F * H, 0.09f);
    layer.phi2_b = random_floats(3 * F, 0.3f);
    layer.filter_w = random_floats(3 * F * R, 0.2f);
    layer.filter_b = random_floats(3 * F, 0.3f);
    layer.u_w = random_floats(F * F, 0.09f);
    layer.v_w = random_floats(F * F, 0.09f);
    layer.mlp1_w = random_floats(K * 2 * F, 0.06f);
    layer.mlp1_b = random_floats(K, 0.3f);
    layer.mlp2_w = random_floats(3 * F * K, 0.09f);
    layer.mlp2_b = random_floats(3 * F, 0.3f);
    layer.phi_activation = layer.update_activation = Activation::kSilu;
  }
  p.readout1_w = random_floats(Kr * F, 0.09f);
  p.readout1_b = random_floats(Kr, 0.3f);
  p.readout2_w = random_floats(Kr, 0.1f);
  p.readout2_b = random_floats(1, 0.1f);

  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int call = 0; call < 20; ++call) launch(p, stream);  // warm-up
  CHECK(cudaStreamSynchronize(stream));

#ifdef MIRAGE_PHASES
  // The mean time from each stamp to the next over 200 calls, each alone on the GPU.
  constexpr int kCalls = 200;
  std::vector<double> sums(kMaxStamps, 0.0);
  int stamps = 0, sites[kMaxStamps] = {};
  for (int call = 0; call < kCalls; ++call) {
    launch(p, stream);
    CHECK(cudaStreamSynchronize(stream));
    unsigned long long times[kMaxStamps];
    CHECK(cudaMemcpyFromSymbol(times, g_stamp_times, sizeof(times)));
    CHECK(cudaMemcpyFromSymbol(sites, g_stamp_sites, sizeof(sites)));
    CHECK(cudaMemcpyFromSymbol(&stamps, g_stamp_count, sizeof(stamps)));
    for (int s = 1; s < stamps; ++s) sums[s] += static_cast<double>(times[s] - times[s - 1]);
  }
  std::printf("block 0 from the stamp before to each stamp (mean of %d calls): us, cumulative, the stamp's place\n",
              kCalls);
  double total = 0.0;
  for (int s = 1; s < stamps; ++s) {
    const double us = sums[s] / kCalls / 1000.0;
    total += us;
    std::printf("  %3d %7.2f %8.2f  %s\n", s, us, total, kStampSites[sites[s]]);
  }
#endif

  cudaGraph_t graph;
  cudaGraphExec_t replay;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int call = 0; call < 20; ++call) launch(p, stream);
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&replay, graph, 0));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  std::vector<float> per_call;
  for (int rep = 0; rep < 200; ++rep) {
    CHECK(cudaEventRecord(start, stream));
    CHECK(cudaGraphLaunch(replay, stream));
    CHECK(cudaEventRecord(stop, stream));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    per_call.push_back(ms * 1000.0f / 20);
  }
  std::sort(per_call.begin(), per_call.end());
  float energy = 0.0f;
  std::vector<float> grad(3 * P);
  CHECK(cudaMemcpy(&energy, p.energy, sizeof(float), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(grad.data(), p.grad_vectors, grad.size() * sizeof(float), cudaMemcpyDeviceToHost));
  double norm = 0.0;
  for (float g : grad) norm += static_cast<double>(g) * g;
  std::printf("%.1f us a call in graphs of 20 (median of 200 replays; fastest %.1f); energy %.7g, |d energy / d vectors| %.7g\n",
              per_call[per_call.size() / 2], per_call.front(), energy, std::sqrt(norm));
  if (argc > 1) {
    FILE* out = std::fopen(argv[1], "wb");
    if (out == nullptr || std::fwrite(grad.data(), sizeof(float), grad.size(), out) != grad.size()) return 1;
    std::fclose(out);
  }
  return 0;
}
