// Shared by the block kernels' MoE products (quant.cpp, kquant.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace hybridkv {

// The P (token, expert) pairs grouped by expert id: pairs[start[g]..start[g + 1]) all use expert
// ids[pairs[start[g]]], in their original order, so a kernel reads each expert row once for all
// the tokens routed to it (as llama.cpp's mul_mat_id does).
inline void group_by_expert(const int64_t* ids, int64_t P, std::vector<int64_t>& pairs, std::vector<int64_t>& start) {
  pairs.resize(P);
  for (int64_t p = 0; p < P; ++p) pairs[p] = p;
  std::stable_sort(pairs.begin(), pairs.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
  start.assign(1, 0);
  for (int64_t i = 1; i <= P; ++i)
    if (i == P || ids[pairs[i]] != ids[pairs[i - 1]]) start.push_back(i);
}

}  // namespace hybridkv
