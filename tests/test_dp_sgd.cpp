// DP-SGD (src/train/dp_sgd.*): every layer type in every clipping mode against
// an independent reference — plain libtorch autograd on one sample at a time,
// through libtorch's own functional ops on the same parameters — and against
// the naive mode; book-keeping clipped gradients; noise; Poisson sampling.
#include <gtest/gtest.h>

#include <functional>
#include <set>
#include <string>
#include <vector>

#include "train/dp_sgd.h"
#include "train/torch_models.h"

namespace memfl::dp {
namespace {

using torch::Tensor;

// One DP layer in a model, the same maths written with libtorch's functional
// ops (the reference), and an input batch.
struct Case {
  std::string name;
  std::shared_ptr<torch::nn::Module> model;
  std::function<Tensor(const Tensor&)> forward;    // through the DP layer
  std::function<Tensor(const Tensor&)> reference;  // libtorch ops on the same parameters
  Tensor input;
};

template <typename Holder>
std::shared_ptr<torch::nn::Module> wrap(Holder layer) {
  auto root = std::make_shared<torch::nn::Module>();
  root->register_module("layer", layer);
  return root;
}

std::vector<Case> make_cases() {
  torch::manual_seed(7);
  std::vector<Case> cases;
  {
    Linear l(7, 5);
    cases.push_back({"Linear2D", wrap(l), [l = l.ptr()](const Tensor& x) { return l->forward(x); },
                     [l = l.ptr()](const Tensor& x) { return x.matmul(l->weight.t()) + l->bias; },
                     torch::randn({6, 7})});
  }
  {
    Linear l(6, 5);  // T = 9: T² = 81 > 30 = d_in·d_out, fused auto takes per-sample gradients
    cases.push_back({"LinearSeq", wrap(l), [l = l.ptr()](const Tensor& x) { return l->forward(x); },
                     [l = l.ptr()](const Tensor& x) { return x.matmul(l->weight.t()) + l->bias; },
                     torch::randn({4, 9, 6})});
  }
  {
    Linear l(16, 12, /*bias=*/false);  // B×2×5×16: T = 10, T² = 100 < 192, fused auto takes the Gram route
    cases.push_back({"LinearSeq4DNoBias", wrap(l), [l = l.ptr()](const Tensor& x) { return l->forward(x); },
                     [l = l.ptr()](const Tensor& x) { return x.matmul(l->weight.t()); }, torch::randn({3, 2, 5, 16})});
  }
  {
    Linear l(6, 6);  // weight sharing: the layer runs twice in one forward
    cases.push_back({"LinearCalledTwice", wrap(l),
                     [l = l.ptr()](const Tensor& x) { return l->forward(torch::tanh(l->forward(x))); },
                     [l = l.ptr()](const Tensor& x) {
                       auto h = torch::tanh(x.matmul(l->weight.t()) + l->bias);
                       return h.matmul(l->weight.t()) + l->bias;
                     },
                     torch::randn({4, 5, 6})});
  }
  {
    Embedding e(11, 4);  // T = 10 tokens from 11: repeats within a sample
    cases.push_back({"Embedding", wrap(e), [e = e.ptr()](const Tensor& x) { return e->forward(x); },
                     [e = e.ptr()](const Tensor& x) {
                       auto sizes = x.sizes().vec();
                       sizes.push_back(e->weight.size(1));
                       return e->weight.index_select(0, x.flatten()).view(sizes);
                     },
                     torch::randint(0, 11, {4, 10}, torch::kLong)});
  }
  {
    Embedding e(9, 3);  // one token per sample (B indices)
    cases.push_back({"EmbeddingOneToken", wrap(e), [e = e.ptr()](const Tensor& x) { return e->forward(x); },
                     [e = e.ptr()](const Tensor& x) { return e->weight.index_select(0, x); },
                     torch::randint(0, 9, {5}, torch::kLong)});
  }
  {
    Conv2d c(3, 4, 3, /*stride=*/2, /*padding=*/1);  // 9×9 → 5×5: T = 25
    cases.push_back({"Conv2d", wrap(c), [c = c.ptr()](const Tensor& x) { return c->forward(x); },
                     [c = c.ptr()](const Tensor& x) {
                       return torch::conv2d(x, c->weight, c->bias, {2, 2}, {1, 1});
                     },
                     torch::randn({4, 3, 9, 9})});
  }
  {
    Conv2d c(2, 3, 3, 1, 0, /*dilation=*/2, /*bias=*/false);  // 8×8 → 4×4
    cases.push_back({"Conv2dDilatedNoBias", wrap(c), [c = c.ptr()](const Tensor& x) { return c->forward(x); },
                     [c = c.ptr()](const Tensor& x) {
                       return torch::conv2d(x, c->weight, Tensor(), {1, 1}, at::IntArrayRef{0, 0}, {2, 2});
                     },
                     torch::randn({3, 2, 8, 8})});
  }
  auto layer_norm_ref = [](const Tensor& x, const Tensor& w, const Tensor& b, double eps) {
    auto mean = x.mean(-1, true);
    auto var = (x - mean).pow(2).mean(-1, true);
    return (x - mean) / torch::sqrt(var + eps) * w + b;
  };
  for (auto shape : {std::vector<int64_t>{4, 6, 8}, std::vector<int64_t>{5, 8}}) {
    LayerNorm n(8);
    {
      torch::NoGradGuard g;  // non-trivial affine parameters
      n->weight.normal_(1.0, 0.5);
      n->bias.normal_(0.0, 0.5);
    }
    cases.push_back(
        {shape.size() == 3 ? "LayerNormSeq" : "LayerNorm2D", wrap(n),
         [n = n.ptr()](const Tensor& x) { return n->forward(x); },
         [n = n.ptr(), layer_norm_ref](const Tensor& x) { return layer_norm_ref(x, n->weight, n->bias, n->eps); },
         torch::randn(shape) * 2 + 0.5});
  }
  {
    RMSNorm n(8);
    {
      torch::NoGradGuard g;
      n->weight.normal_(1.0, 0.5);
    }
    cases.push_back(
        {"RMSNorm", wrap(n), [n = n.ptr()](const Tensor& x) { return n->forward(x); },
         [n = n.ptr()](const Tensor& x) { return x / torch::sqrt(x.pow(2).mean(-1, true) + n->eps) * n->weight; },
         torch::randn({4, 6, 8})});
  }
  {
    GroupNorm n(3, 6);
    {
      torch::NoGradGuard g;
      n->weight.normal_(1.0, 0.5);
      n->bias.normal_(0.0, 0.5);
    }
    cases.push_back({"GroupNorm", wrap(n), [n = n.ptr()](const Tensor& x) { return n->forward(x); },
                     [n = n.ptr()](const Tensor& x) { return torch::group_norm(x, 3, n->weight, n->bias, n->eps); },
                     torch::randn({4, 6, 5, 5})});
  }
  return cases;
}

std::vector<Tensor> params_of(const Case& c) { return c.model->parameters(); }

Tensor flat_grads(const std::vector<Tensor>& ps) {
  std::vector<Tensor> gs;
  for (auto& p : ps) gs.push_back(p.grad().defined() ? p.grad().flatten() : torch::zeros({p.numel()}, p.options()));
  return torch::cat(gs);
}

// Per-sample loss weights spread over 20×, so some samples clip and others do not.
Tensor sample_weights(int64_t batch) { return torch::linspace(0.2, 4.0, batch); }

// loss = Σ_i w_i Σ (y_i ⊙ R_i): sample i's output gradient is w_i·R_i.
Tensor weighted_loss(const Tensor& y, const Tensor& r, const Tensor& w) {
  std::vector<int64_t> shape(static_cast<size_t>(y.dim()), 1);
  shape[0] = y.size(0);
  return (y * r * w.view(shape)).sum();
}

struct Reference {
  Tensor norms;                         // B
  std::vector<Tensor> grads;            // per sample, flattened over all parameters
  Tensor clipped(double c_max) const {  // Σ_i min(1, C/(‖g_i‖+1e-6)) g_i
    Tensor sum = torch::zeros_like(grads[0]);
    for (size_t i = 0; i < grads.size(); ++i) {
      const double n = norms[static_cast<int64_t>(i)].item<double>();
      sum += grads[i] * std::min(1.0, c_max / (n + 1e-6));
    }
    return sum;
  }
};

// Plain autograd, one sample at a time, through the reference ops.
Reference per_sample_reference(const Case& c, const Tensor& r, const Tensor& w) {
  auto ps = params_of(c);
  Reference ref;
  const int64_t batch = c.input.size(0);
  std::vector<double> norms;
  for (int64_t i = 0; i < batch; ++i) {
    Tensor y = c.reference(c.input.narrow(0, i, 1));
    Tensor loss = weighted_loss(y, r.narrow(0, i, 1), w.narrow(0, i, 1));
    auto gs = torch::autograd::grad({loss}, ps);
    std::vector<Tensor> flat;
    for (auto& g : gs) flat.push_back(g.flatten());
    ref.grads.push_back(torch::cat(flat));
    norms.push_back(ref.grads.back().norm().item<double>());
  }
  ref.norms = torch::tensor(norms, torch::kFloat64).to(torch::kFloat32);
  return ref;
}

void expect_rel_close(const Tensor& got_any, const Tensor& want_any, double rel, const std::string& what) {
  ASSERT_TRUE(got_any.defined()) << what;
  const Tensor got = got_any.cpu(), want = want_any.cpu();
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  if (want.dim() == 1 && want.numel() < 64) {  // norms: each one within rel
    Tensor err = (got - want).abs() / want.abs().clamp_min(1e-12);
    EXPECT_LE(err.max().item<double>(), rel) << what << "\n got " << got << "\n want " << want;
  } else {  // a gradient vector: relative error in norm
    const double err = (got - want).norm().item<double>() / want.norm().item<double>();
    EXPECT_LE(err, rel) << what;
  }
}

struct Variant {
  std::string name;
  DpOptions options;
};

std::vector<Variant> variants() {
  std::vector<Variant> v;
  DpOptions o;
  o.noise_multiplier = 0;
  o.mode = ClipMode::kNaive;
  v.push_back({"naive", o});
  o.mode = ClipMode::kGhost;
  v.push_back({"ghost", o});
  o.mode = ClipMode::kFused;
  v.push_back({"fused", o});
  o.tile = 3;  // tiles smaller than T (and not dividing it)
  v.push_back({"fused-tile3", o});
  o.fused_route = FusedRoute::kGram;
  v.push_back({"fused-tile3-gram", o});
  o.tile = 2;  // a budget of B·4 elements: per-sample gradients one sample at a time
  o.fused_route = FusedRoute::kPerSampleNorms;
  v.push_back({"fused-tile2-per-sample-norms", o});
  o.fused_route = FusedRoute::kKeepPerSample;
  v.push_back({"fused-keep-per-sample", o});
  return v;
}

// Runs the DP layer with `o` on the whole batch; returns (norms, flat clipped gradient).
std::pair<Tensor, Tensor> run_dp(const Case& c, const DpOptions& o, const Tensor& r, const Tensor& w, double c_max) {
  DpOptions opts = o;
  opts.max_grad_norm = c_max;
  auto dp = DpSgd::create(c.model, opts);
  EXPECT_TRUE(dp.ok()) << dp.status().to_string();
  auto ps = params_of(c);
  for (auto& p : ps) p.mutable_grad() = Tensor();
  Tensor y = c.forward(c.input);
  weighted_loss(y, r, w).backward();
  Tensor norms = (*dp)->per_sample_norms().clone();
  auto st = (*dp)->step(1.0);  // expected batch 1: the gradient is the clipped sum itself
  EXPECT_TRUE(st.ok()) << st.status().to_string();
  EXPECT_EQ(st->batch_size, c.input.size(0));
  for (auto& p : ps) {
    EXPECT_FALSE(p.grad().is_view()) << "an optimizer's zero_grad() cannot detach a view in place";
    EXPECT_EQ(p.grad().sizes(), p.sizes());
  }
  return {norms, flat_grads(ps)};
}

void check_every_layer_and_mode(torch::Device device) {
  for (Case c : make_cases()) {
    SCOPED_TRACE(c.name);
    c.model->to(device);
    c.input = c.input.to(device);
    // The DP layer in plain mode (no DpSgd) is the libtorch layer.
    Tensor y_ref = c.reference(c.input);
    Tensor y = c.forward(c.input);
    ASSERT_TRUE(torch::allclose(y, y_ref, 1e-5, 1e-5)) << c.name << ": forward differs from the reference";

    const Tensor r = torch::randn_like(y_ref.detach());
    const Tensor w = sample_weights(c.input.size(0)).to(device);
    const Reference ref = per_sample_reference(c, r, w);
    // C at the median norm: about half the samples are clipped.
    const double c_max = ref.norms.median().item<double>();
    const Tensor ref_clipped = ref.clipped(c_max);

    Tensor naive_norms, naive_grads;
    for (const Variant& v : variants()) {
      SCOPED_TRACE(v.name);
      auto [norms, grads] = run_dp(c, v.options, r, w, c_max);
      expect_rel_close(norms, ref.norms, 1e-4, c.name + " " + v.name + " norms vs per-sample autograd");
      expect_rel_close(grads, ref_clipped, 1e-4, c.name + " " + v.name + " clipped gradient vs per-sample loop");
      if (v.options.mode == ClipMode::kNaive) {
        naive_norms = norms;
        naive_grads = grads;
      } else {
        expect_rel_close(norms, naive_norms, 1e-4, c.name + " " + v.name + " norms vs naive");
        expect_rel_close(grads, naive_grads, 1e-4, c.name + " " + v.name + " clipped gradient vs naive");
      }
    }
  }
}

TEST(DpSgd, EveryLayerAndModeMatchesPerSampleAutogradAndNaive) { check_every_layer_and_mode(torch::kCPU); }

// Only in CUDA builds of libtorch (the GPU machine's), where it must find a
// device: CI's CPU build has no such test rather than a skipped one.
#if __has_include(<c10/cuda/CUDACachingAllocator.h>) && __has_include(<cuda_runtime_api.h>)
TEST(DpSgd, EveryLayerAndModeMatchesOnCuda) {
  ASSERT_TRUE(torch::cuda::is_available()) << "a CUDA build of libtorch without a CUDA device";
  // fp32 means fp32: no TF32 in cuDNN convolutions or cuBLAS matmuls.
  at::globalContext().setAllowTF32CuDNN(false);
  at::globalContext().setAllowTF32CuBLAS(false);
  check_every_layer_and_mode(torch::kCUDA);
}
#endif

TEST(DpSgd, FusedTilesSmallerThanTGiveTheSameNorms) {
  torch::manual_seed(3);
  const int64_t t_len = 33;
  Linear l(8, 8);
  Embedding e(40, 6);
  struct Layer {
    std::shared_ptr<torch::nn::Module> model;
    std::function<Tensor()> forward;
  };
  const Tensor x = torch::randn({3, t_len, 8});
  const Tensor idx = torch::randint(0, 40, {3, t_len}, torch::kLong);
  std::vector<Layer> layers = {{wrap(l), [&] { return l->forward(x); }}, {wrap(e), [&] { return e->forward(idx); }}};
  for (auto& layer : layers) {
    const Tensor r = torch::randn_like(layer.forward().detach());
    auto norms_with = [&](DpOptions o) {
      auto dp = DpSgd::create(layer.model, o);
      EXPECT_TRUE(dp.ok());
      (layer.forward() * r).sum().backward();
      Tensor n = (*dp)->per_sample_norms().clone();
      (*dp)->clear();
      return n;
    };
    DpOptions o;
    o.mode = ClipMode::kGhost;
    const Tensor ghost = norms_with(o);  // the full 33×33 Gram matrices
    o.mode = ClipMode::kFused;
    o.fused_route = FusedRoute::kGram;
    for (int64_t tile : {1, 4, 5, 16, 32, 33, 64}) {
      o.tile = tile;
      expect_rel_close(norms_with(o), ghost, 1e-4, "tile " + std::to_string(tile));
    }
  }
}

TEST(DpSgd, WholeGroupNormCnnMatchesPlainAutogradPerSample) {
  torch::manual_seed(11);
  auto net = make_groupnorm_cnn(1, 28, 10);
  std::shared_ptr<torch::nn::Module> model = net;
  const Tensor x = torch::randn({3, 1, 28, 28});
  const Tensor y = torch::tensor({3, 7, 1}, torch::kLong);
  auto ps = model->parameters();
  // Reference: the model's layers in plain mode (no DpSgd), one sample at a time.
  Reference ref;
  std::vector<double> norms;
  for (int64_t i = 0; i < 3; ++i) {
    auto loss =
        torch::nn::functional::cross_entropy(net->forward(x.narrow(0, i, 1)), y.narrow(0, i, 1),
                                             torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
    std::vector<Tensor> flat;
    for (auto& g : torch::autograd::grad({loss}, ps)) flat.push_back(g.flatten());
    ref.grads.push_back(torch::cat(flat));
    norms.push_back(ref.grads.back().norm().item<double>());
  }
  ref.norms = torch::tensor(norms, torch::kFloat64).to(torch::kFloat32);
  // C between the two smallest norms: two of the three samples are clipped.
  const Tensor sorted = std::get<0>(ref.norms.sort());
  const double c_max = 0.5 * (sorted[0].item<double>() + sorted[1].item<double>());
  const Tensor ref_clipped = ref.clipped(c_max);
  for (ClipMode mode : {ClipMode::kNaive, ClipMode::kGhost, ClipMode::kFused}) {
    SCOPED_TRACE(clip_mode_name(mode));
    DpOptions o;
    o.mode = mode;
    o.noise_multiplier = 0;
    o.max_grad_norm = c_max;
    auto dp = DpSgd::create(model, o);
    ASSERT_TRUE(dp.ok()) << dp.status().to_string();
    auto loss = torch::nn::functional::cross_entropy(
        net->forward(x), y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
    loss.backward();
    expect_rel_close((*dp)->per_sample_norms(), ref.norms, 1e-4, "CNN_GN norms");
    auto st = (*dp)->step(1.0);
    ASSERT_TRUE(st.ok());
    EXPECT_NEAR(st->clipped_fraction, 2.0 / 3.0, 1e-9);
    expect_rel_close(flat_grads(ps), ref_clipped, 1e-4, "CNN_GN clipped gradient");
  }
}

TEST(DpSgd, RegistryBuildsCnnGn) {
  ModelConfig m;
  m.model_name = "CNN_GN";
  InputSpec in;  // 1×28×28, 10 classes
  auto net = torch_internal::make_model(m, in);
  ASSERT_TRUE(net.ok()) << net.status().to_string();
  int64_t n = 0;
  for (auto& p : (*net)->parameters()) n += p.numel();
  // conv 1·32·25+32, gn 64, conv 32·64·25+64, gn 128, fc 1024·512+512, fc 512·10+10
  EXPECT_EQ(n, 832 + 64 + 51264 + 128 + 524800 + 5130);
  EXPECT_TRUE(DpSgd::create(*net, DpOptions{}).ok());
  EXPECT_EQ((*net)->forward(torch::randn({2, 1, 28, 28})).sizes(), (std::vector<int64_t>{2, 10}));
}

TEST(DpSgd, RejectsBatchNormWithAMessage) {
  auto model = std::make_shared<torch::nn::Module>();
  model->register_module("conv", Conv2d(1, 4, 3));
  model->register_module("bn", torch::nn::BatchNorm2d(4));
  auto dp = DpSgd::create(model, DpOptions{});
  ASSERT_FALSE(dp.ok());
  const std::string msg = dp.status().message();
  EXPECT_NE(msg.find("BatchNorm"), std::string::npos) << msg;
  EXPECT_NE(msg.find("GroupNorm"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'bn'"), std::string::npos) << msg;
  // So is the registry's ResNet18 (BatchNorm throughout) — and a plain nn::Linear, which has no per-sample grads.
  ModelConfig m;
  m.model_name = "ResNet18";
  InputSpec in{3, 32, 32, 10};
  auto resnet = torch_internal::make_model(m, in);
  ASSERT_TRUE(resnet.ok());
  auto r = DpSgd::create(*resnet, DpOptions{});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("BatchNorm"), std::string::npos) << r.status().message();
  auto plain = std::make_shared<torch::nn::Module>();
  plain->register_module("fc", torch::nn::Linear(3, 2));
  auto p = DpSgd::create(plain, DpOptions{});
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("'fc'"), std::string::npos) << p.status().message();
}

TEST(DpSgd, NoiseAndAveraging) {
  torch::manual_seed(5);
  Linear l(200, 100);
  auto model = wrap(l);
  DpOptions o;
  o.noise_multiplier = 2.0;
  o.max_grad_norm = 0.5;
  auto dp = DpSgd::create(model, o);
  ASSERT_TRUE(dp.ok());
  // An empty Poisson batch: no forward; the gradient is N(0, σ²C²)/E.
  auto st = (*dp)->step(10.0);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->batch_size, 0);
  Tensor g = flat_grads(model->parameters());
  EXPECT_NEAR(g.std().item<double>(), 2.0 * 0.5 / 10.0, 0.003);
  EXPECT_NEAR(g.mean().item<double>(), 0.0, 0.002);
  // With a batch and no noise: the clipped sum divided by the expected batch size.
  o.noise_multiplier = 0;
  dp->reset();  // detach the layers before attaching them to another DpSgd
  auto dp2 = DpSgd::create(model, o);
  ASSERT_TRUE(dp2.ok());
  const Tensor x = torch::randn({4, 200});
  l->forward(x).sum().backward();
  Tensor norms = (*dp2)->per_sample_norms().clone();
  ASSERT_TRUE((*dp2)->step(1.0).ok());
  Tensor sum_grad = flat_grads(model->parameters()).clone();
  l->forward(x).sum().backward();
  st = (*dp2)->step(4.0);
  ASSERT_TRUE(st.ok());
  expect_rel_close(flat_grads(model->parameters()), sum_grad / 4.0, 1e-6, "divided by E");
  EXPECT_NEAR(st->mean_norm, norms.mean().item<double>(), 1e-4 * st->mean_norm);
  EXPECT_TRUE((*dp2)->step(0.0).status().code() == StatusCode::kInvalidArgument);
}

TEST(DpSgd, DetachedLayersComputePlainGradients) {
  // A forward taken while recording, whose DpSgd is gone before the backward,
  // still gives the ordinary summed gradients.
  for (const Case& c : make_cases()) {
    SCOPED_TRACE(c.name);
    auto ps = params_of(c);
    for (auto& p : ps) p.mutable_grad() = Tensor();
    c.reference(c.input).sum().backward();
    Tensor want = flat_grads(ps).clone();
    for (auto& p : ps) p.mutable_grad() = Tensor();
    Tensor y;
    {
      auto dp = DpSgd::create(c.model, DpOptions{});
      ASSERT_TRUE(dp.ok());
      y = c.forward(c.input);
    }
    y.sum().backward();
    expect_rel_close(flat_grads(ps), want, 1e-5, c.name + " plain gradient after detaching");
  }
}

TEST(PoissonSampler, IncludesEachSampleWithProbabilityQ) {
  std::vector<uint32_t> pool(1000);
  for (uint32_t i = 0; i < 1000; ++i) pool[i] = 5000 + 2 * i;
  PoissonSampler s(pool, 0.05, 42);
  EXPECT_DOUBLE_EQ(s.expected_batch_size(), 50.0);
  EXPECT_EQ(s.steps_per_epoch(), 20);
  std::vector<uint32_t> batch;
  std::vector<int> hits(1000, 0);
  double total = 0;
  const int steps = 2000;
  for (int k = 0; k < steps; ++k) {
    s.next(batch);
    total += static_cast<double>(batch.size());
    ASSERT_TRUE(std::is_sorted(batch.begin(), batch.end()));
    ASSERT_EQ(std::set<uint32_t>(batch.begin(), batch.end()).size(), batch.size());
    for (uint32_t v : batch) {
      ASSERT_TRUE(v >= 5000 && v < 7000 && v % 2 == 0);
      hits[(v - 5000) / 2]++;
    }
  }
  EXPECT_NEAR(total / steps, 50.0, 1.0);  // Binomial(1000, 0.05): sd of the mean ≈ 0.15
  // Every sample is picked about q·steps = 100 times (sd 10); none never.
  EXPECT_GT(*std::min_element(hits.begin(), hits.end()), 50);
  EXPECT_LT(*std::max_element(hits.begin(), hits.end()), 150);

  // Small pools give empty batches, which are steps too.
  PoissonSampler tiny(std::span<const uint32_t>(pool).first(10), 0.05, 1);
  int empty = 0;
  for (int k = 0; k < 200; ++k) {
    tiny.next(batch);
    empty += batch.empty();
  }
  EXPECT_GT(empty, 100);  // P(empty) = 0.95^10 ≈ 0.6
  PoissonSampler all(std::span<const uint32_t>(pool).first(10), 1.0, 1);
  all.next(batch);
  EXPECT_EQ(batch.size(), 10u);
  EXPECT_THROW(PoissonSampler(pool, 0.0, 1), std::invalid_argument);
  EXPECT_THROW(PoissonSampler(pool, 1.5, 1), std::invalid_argument);
}

TEST(DpSgd, ParsesModes) {
  EXPECT_EQ(parse_clip_mode("naive"), ClipMode::kNaive);
  EXPECT_EQ(parse_clip_mode("ghost"), ClipMode::kGhost);
  EXPECT_EQ(parse_clip_mode("fused"), ClipMode::kFused);
  EXPECT_FALSE(parse_clip_mode("hooks").has_value());
  for (ClipMode m : {ClipMode::kNaive, ClipMode::kGhost, ClipMode::kFused}) {
    EXPECT_EQ(parse_clip_mode(clip_mode_name(m)), m);
  }
}

}  // namespace
}  // namespace memfl::dp
