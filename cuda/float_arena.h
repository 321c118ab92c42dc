// The whole-model force-field ops' workspace layouts (schnet_energy, painn_energy) and
// schnet_energy_prepare's output: consecutive float arrays, each 16-byte aligned. Host and device
// code, free of CUDA and torch headers (the CPU reference builds the prepared layout too).
#pragma once

#include <cstdint>

#include "filter_table.h"
#include "host_device.h"
#include "kinds.h"

namespace mirage::cuda::atomwise {

MIRAGE_HOST_DEVICE inline int64_t pad4(int64_t n) { return (n + 3) / 4 * 4; }

// Floats a rows x cols matrix takes in a workspace array of them, 16-byte aligned.
MIRAGE_HOST_DEVICE inline int64_t padded_matrix(int64_t rows, int64_t cols) { return pad4(rows * cols); }

// Hands out the consecutive float arrays of a layout, each 16-byte aligned.
struct FloatArena {
  int64_t size = 0;
  MIRAGE_HOST_DEVICE int64_t take(int64_t floats) {
    const int64_t offset = size;
    size += pad4(floats);
    return offset;
  }
  // Room for n items of a struct whose size is a whole number of floats (OwnPair, PairGeometry).
  template <typename T>
  MIRAGE_HOST_DEVICE int64_t take_items(int64_t n) {
    static_assert(sizeof(T) % sizeof(float) == 0, "FloatArena: the size must be a whole number of floats");
    return take(n * static_cast<int64_t>(sizeof(T) / sizeof(float)));
  }
};

// schnet_energy's atom-wise weights transposed, for its backward's products, in floats from the
// start of their block: readout.0 [F][Kr], then per interaction f2out.2 [K][F], f2out.0 [M][K],
// and per interaction but the first in2f [F][M] (each interaction's matrix padded_matrix(...)
// floats after the last one's). The backward never goes through the first in2f: its input is
// the embedding, which has no gradient in the positions.
struct SchnetTransposed {
  int64_t readout1, f2out2, f2out1, in2f, total;
};

MIRAGE_HOST_DEVICE inline SchnetTransposed schnet_transposed(int64_t interactions, int64_t features,
                                                             int64_t message_width, int64_t update_hidden,
                                                             int64_t readout_hidden) {
  const int64_t T = interactions, F = features, M = message_width, K = update_hidden;
  FloatArena arena;
  SchnetTransposed l{};
  l.readout1 = arena.take(F * readout_hidden);
  l.f2out2 = arena.take(T * padded_matrix(K, F));
  l.f2out1 = arena.take(T * padded_matrix(M, K));
  l.in2f = arena.take((T - 1) * padded_matrix(F, M));
  l.total = arena.size;
  return l;
}

// The pieces of each of schnet_energy_prepare's tables: its Gaussians' (filter_table.h).
MIRAGE_HOST_DEVICE inline int64_t schnet_table_intervals(int64_t rbf) {
  return filter_table::intervals_for(RadialBasisKind::kGaussian, rbf);
}

// schnet_energy_prepare's output starts with each interaction's filter network as radial_cfconv's
// table (filter_table.h; SchNet's Gaussians and cosine cutoff), [T][intervals][6][M], this many
// floats.
MIRAGE_HOST_DEVICE inline int64_t schnet_tables_floats(int64_t interactions, int64_t rbf, int64_t message_width) {
  return pad4(interactions * schnet_table_intervals(rbf) * filter_table::kCoefficients * message_width);
}

// The rest of schnet_energy_prepare's output, in floats from its start: the transposed weights
// (SchnetTransposed), then the first interaction's in2f of every embedding row, [Z][M]. An atom's
// first h depends on its species alone, so the op looks it up instead of computing it.
struct SchnetPrepared {
  int64_t transposed, first_h, total;
};

MIRAGE_HOST_DEVICE inline SchnetPrepared schnet_prepared(int64_t interactions, int64_t rbf, int64_t embeddings,
                                                         int64_t features, int64_t message_width,
                                                         int64_t update_hidden, int64_t readout_hidden) {
  FloatArena arena;
  arena.take(schnet_tables_floats(interactions, rbf, message_width));
  SchnetPrepared l{};
  l.transposed = arena.take(
      schnet_transposed(interactions, features, message_width, update_hidden, readout_hidden).total);
  l.first_h = arena.take(embeddings * message_width);
  l.total = arena.size;
  return l;
}

}  // namespace mirage::cuda::atomwise
