#include "distca/kernels/ref.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace distca::kernels::ref {
namespace {

// Keys [0, visible) of the task's range are seen by query i of the task.
int64_t visible_keys(const AttnTask& t, int64_t i) {
  return t.is_causal ? t.kv_len - t.q_len + i + 1 : t.kv_len;
}

template <typename T>
double at(const T* base, int64_t row, int64_t num_heads, int64_t head, int64_t d, int64_t dim) {
  return to_float(base[(row * num_heads + head) * dim + d]);
}

}  // namespace

template <typename T, typename Acc>
Status attention_forward(const AttnFwdParams<T>& p) {
  DISTCA_RETURN_IF_ERROR(validate(p));
  const AttnDims& n = p.dims;
  const int64_t D = n.head_dim;
  const int64_t group = n.num_q_heads / n.num_kv_heads;
  const Acc scale = softmax_scale(n, p.scale);
  std::fill(p.o, p.o + n.num_q_rows * n.num_q_heads * D, from_float<T>(0.0f));
  std::fill(p.lse, p.lse + n.num_q_rows * n.num_q_heads, -std::numeric_limits<float>::infinity());
  std::vector<Acc> s, acc(D);
  for (const AttnTask& t : p.tasks) {
    for (int64_t h = 0; h < n.num_q_heads; ++h) {
      const int64_t hk = h / group;
      for (int64_t i = 0; i < t.q_len; ++i) {
        const int64_t qrow = t.q_offset + i;
        const int64_t nk = visible_keys(t, i);
        if (nk <= 0) continue;
        s.assign(nk, Acc(0));
        Acc m = -std::numeric_limits<Acc>::infinity();
        for (int64_t j = 0; j < nk; ++j) {
          Acc dot = 0;
          for (int64_t d = 0; d < D; ++d) {
            dot += static_cast<Acc>(at(p.q, qrow, n.num_q_heads, h, d, D)) *
                   static_cast<Acc>(at(p.k, t.kv_offset + j, n.num_kv_heads, hk, d, D));
          }
          s[j] = dot * scale;
          m = std::max(m, s[j]);
        }
        Acc l = 0;
        std::fill(acc.begin(), acc.end(), Acc(0));
        for (int64_t j = 0; j < nk; ++j) {
          const Acc e = std::exp(s[j] - m);
          l += e;
          for (int64_t d = 0; d < D; ++d) {
            acc[d] += e * static_cast<Acc>(at(p.v, t.kv_offset + j, n.num_kv_heads, hk, d, D));
          }
        }
        for (int64_t d = 0; d < D; ++d) {
          p.o[(qrow * n.num_q_heads + h) * D + d] = from_float<T>(static_cast<float>(acc[d] / l));
        }
        p.lse[qrow * n.num_q_heads + h] = static_cast<float>(m + std::log(l));
      }
    }
  }
  return Status::ok();
}

template <typename T, typename Acc>
Status attention_backward(const AttnBwdParams<T>& p, bool is_using_given_output) {
  DISTCA_RETURN_IF_ERROR(validate(p));
  const AttnDims& n = p.dims;
  const int64_t D = n.head_dim;
  const int64_t group = n.num_q_heads / n.num_kv_heads;
  const Acc scale = softmax_scale(n, p.scale);
  std::vector<Acc> dq(n.num_q_rows * n.num_q_heads * D, Acc(0));
  std::vector<Acc> dk(n.num_kv_rows * n.num_kv_heads * D, Acc(0));
  std::vector<Acc> dv(dk.size(), Acc(0));
  std::vector<Acc> s, dp, o(D);
  for (const AttnTask& t : p.tasks) {
    for (int64_t h = 0; h < n.num_q_heads; ++h) {
      const int64_t hk = h / group;
      for (int64_t i = 0; i < t.q_len; ++i) {
        const int64_t qrow = t.q_offset + i;
        const int64_t nk = visible_keys(t, i);
        if (nk <= 0) continue;
        const int64_t kv0 = t.kv_offset;
        auto q = [&](int64_t d) -> Acc { return at(p.q, qrow, n.num_q_heads, h, d, D); };
        auto k = [&](int64_t j, int64_t d) -> Acc { return at(p.k, kv0 + j, n.num_kv_heads, hk, d, D); };
        auto v = [&](int64_t j, int64_t d) -> Acc { return at(p.v, kv0 + j, n.num_kv_heads, hk, d, D); };
        auto d_o = [&](int64_t d) -> Acc { return at(p.d_o, qrow, n.num_q_heads, h, d, D); };
        // Forward, recomputed: P (normalized), O.
        s.assign(nk, Acc(0));
        Acc m = -std::numeric_limits<Acc>::infinity();
        for (int64_t j = 0; j < nk; ++j) {
          Acc dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += q(d) * k(j, d);
          s[j] = dot * scale;
          m = std::max(m, s[j]);
        }
        Acc l = 0;
        for (int64_t j = 0; j < nk; ++j) l += std::exp(s[j] - m);
        std::fill(o.begin(), o.end(), Acc(0));
        for (int64_t j = 0; j < nk; ++j) {
          s[j] = std::exp(s[j] - m) / l;  // now P
          for (int64_t d = 0; d < D; ++d) o[d] += s[j] * v(j, d);
        }
        Acc delta = 0;  // dO . O
        for (int64_t d = 0; d < D; ++d) {
          delta += d_o(d) * (is_using_given_output ? at(p.o, qrow, n.num_q_heads, h, d, D) : o[d]);
        }
        for (int64_t j = 0; j < nk; ++j) {
          Acc dpj = 0;
          for (int64_t d = 0; d < D; ++d) dpj += d_o(d) * v(j, d);
          const Acc ds = s[j] * (dpj - delta);
          const int64_t kvrow = ((t.kv_offset + j) * n.num_kv_heads + hk) * D;
          for (int64_t d = 0; d < D; ++d) {
            dq[(qrow * n.num_q_heads + h) * D + d] += scale * ds * k(j, d);
            dk[kvrow + d] += scale * ds * q(d);
            dv[kvrow + d] += s[j] * d_o(d);
          }
        }
      }
    }
  }
  for (std::size_t i = 0; i < dq.size(); ++i) p.dq[i] = from_float<T>(static_cast<float>(dq[i]));
  for (std::size_t i = 0; i < dk.size(); ++i) {
    p.dk[i] = from_float<T>(static_cast<float>(dk[i]));
    p.dv[i] = from_float<T>(static_cast<float>(dv[i]));
  }
  return Status::ok();
}

#define DISTCA_REF_INSTANTIATE(T, Acc)                                  \
  template Status attention_forward<T, Acc>(const AttnFwdParams<T>&); \
  template Status attention_backward<T, Acc>(const AttnBwdParams<T>&, bool);
DISTCA_REF_INSTANTIATE(float, double)
DISTCA_REF_INSTANTIATE(float, float)
DISTCA_REF_INSTANTIATE(bf16, double)
DISTCA_REF_INSTANTIATE(bf16, float)
#undef DISTCA_REF_INSTANTIATE

void dense_document_forward(const DenseDocument& doc, const double* q, const double* k,
                            const double* v, double* o, double* lse) {
  const int64_t L = doc.length, Hq = doc.num_q_heads, Hkv = doc.num_kv_heads, D = doc.head_dim;
  const double scale = doc.scale ? *doc.scale : 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<double> S(L * L);  // [L, L] scores of one head, -inf above the diagonal
  for (int64_t h = 0; h < Hq; ++h) {
    const int64_t hk = h / (Hq / Hkv);
    for (int64_t i = 0; i < L; ++i) {
      for (int64_t j = 0; j < L; ++j) {
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += q[(i * Hq + h) * D + d] * k[(j * Hkv + hk) * D + d];
        S[i * L + j] = j <= i ? dot * scale : -std::numeric_limits<double>::infinity();
      }
    }
    for (int64_t i = 0; i < L; ++i) {
      const double m = *std::max_element(&S[i * L], &S[i * L] + L);
      double l = 0;
      for (int64_t j = 0; j < L; ++j) l += std::exp(S[i * L + j] - m);
      lse[i * Hq + h] = m + std::log(l);
      for (int64_t d = 0; d < D; ++d) {
        double acc = 0;
        for (int64_t j = 0; j < L; ++j) acc += std::exp(S[i * L + j] - m) / l * v[(j * Hkv + hk) * D + d];
        o[(i * Hq + h) * D + d] = acc;
      }
    }
  }
}

void dense_document_backward(const DenseDocument& doc, const double* q, const double* k,
                             const double* v, const double* d_o, double* dq, double* dk,
                             double* dv) {
  const int64_t L = doc.length, Hq = doc.num_q_heads, Hkv = doc.num_kv_heads, D = doc.head_dim;
  const double scale = doc.scale ? *doc.scale : 1.0 / std::sqrt(static_cast<double>(D));
  std::fill(dq, dq + L * Hq * D, 0.0);
  std::fill(dk, dk + L * Hkv * D, 0.0);
  std::fill(dv, dv + L * Hkv * D, 0.0);
  std::vector<double> P(L * L), dP(L * L);  // [L, L] per head
  for (int64_t h = 0; h < Hq; ++h) {
    const int64_t hk = h / (Hq / Hkv);
    for (int64_t i = 0; i < L; ++i) {
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j <= i; ++j) {
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += q[(i * Hq + h) * D + d] * k[(j * Hkv + hk) * D + d];
        P[i * L + j] = dot * scale;
        m = std::max(m, P[i * L + j]);
      }
      double l = 0;
      for (int64_t j = 0; j < L; ++j) {
        P[i * L + j] = j <= i ? std::exp(P[i * L + j] - m) : 0.0;
        l += P[i * L + j];
      }
      for (int64_t j = 0; j < L; ++j) P[i * L + j] /= l;
      for (int64_t j = 0; j < L; ++j) {
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += d_o[(i * Hq + h) * D + d] * v[(j * Hkv + hk) * D + d];
        dP[i * L + j] = dot;
      }
      double row = 0;  // rowsum(P * dP)
      for (int64_t j = 0; j < L; ++j) row += P[i * L + j] * dP[i * L + j];
      for (int64_t j = 0; j < L; ++j) {
        const double ds = P[i * L + j] * (dP[i * L + j] - row);
        for (int64_t d = 0; d < D; ++d) {
          dq[(i * Hq + h) * D + d] += scale * ds * k[(j * Hkv + hk) * D + d];
          dk[(j * Hkv + hk) * D + d] += scale * ds * q[(i * Hq + h) * D + d];
          dv[(j * Hkv + hk) * D + d] += P[i * L + j] * d_o[(i * Hq + h) * D + d];
        }
      }
    }
  }
}

}  // namespace distca::kernels::ref
