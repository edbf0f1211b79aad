// What APPFL's compressor_configs ask for, resolved to memfl's codecs
// (config/config.h: CompressorConfig holds the keys as APPFL writes them).
//
//   lossy_compressor   ZFPCompressor → ZFP (libzfp) in fixed-accuracy mode;
//                      SZ2Compressor, SZ3Compressor, SZxCompressor → memfl's
//                      error-bounded quantiser (compress/lossy.h): SZ is not
//                      packaged by Debian, and running the config as written
//                      under the same bound contract (logged: which codec ran
//                      for which name) serves APPFL users better than a
//                      refusal; its ratio is SZ's scheme without SZ's Huffman
//                      stage (docs/BENCHMARKS.md, "Compression").
//                      none → lossless only (a memfl addition).
//   lossless_compressor  the frame's lossless stage.
//   error_bounding_mode / error_bound  ABS: every element of the update's
//                      change within error_bound; REL: within error_bound ×
//                      (max − min) of that tensor's change this round (APPFL's
//                      REL for ZFP), computed over the whole tensor on the
//                      client before the first chunk leaves and carried in
//                      every frame, so chunk edges do not move it.
//   param_cutoff       APPFL's rule: a tensor goes lossy only when its name
//                      contains "weight" and it has more elements than this;
//                      the rest (biases, norms, counters) go lossless.
//   error_feedback     the client keeps what the codec lost and adds it to its
//                      next update.
//   broadcast_compression  (memfl's) lossy: the global model leaves as its
//                      change since the last broadcast, coded like an update
//                      (compress/broadcast_delta.h).
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "compress/lossless.h"
#include "compress/lossy.h"
#include "config/config.h"
#include "tensor/layout.h"

namespace memfl {

struct CompressionSettings {
  bool enabled = false;
  Lossy lossy = Lossy::kNone;
  std::string lossy_name;  // as configured (ZFPCompressor, SZ3Compressor, …)
  Lossless lossless = Lossless::kZstd;
  bool relative = true;
  double error_bound = 1e-3;
  int64_t param_cutoff = 1024;
  bool error_feedback = false;
  // broadcast_compression: lossy (compress/broadcast_delta.h).
  bool lossy_broadcast = false;
  // Whether `entry` goes through the lossy codec (APPFL's rule, above).
  bool lossy_tensor(const LayoutEntry& entry) const;
};

CompressionSettings compression_settings(const ExperimentConfig& cfg);
// "ZFPCompressor → zfp, REL 0.001, zstd, error feedback", for the log.
std::string describe_compression(const CompressionSettings& s);
// The same for summary.json: the configured names and the codecs that ran.
nlohmann::ordered_json compression_summary(const CompressionSettings& s);

}  // namespace memfl
