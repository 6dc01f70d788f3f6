// The C ABI (include/dattn/dattn.h) over the C++ API: one translation unit, built into the
// shared library libdattn_c.so, which exports these functions only. Every entry point catches
// everything: the C++ errors become status codes and the thread's message; nothing crosses.
#include "dattn/dattn.h"

#include <cmath>
#include <cstddef>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <string_view>

#include "core/strings.hpp"
#include "dattn/attention.hpp"
#include "dattn/errors.hpp"
#include "dattn/memory.hpp"
#include "dattn/metadata.hpp"
#include "dattn/tensor.hpp"
#include "dattn/threads.hpp"

struct dattn_layer {
  dattn::Attention attention;
  int threads = 0;
  std::string backend;
};

namespace {

thread_local std::string g_message;
thread_local std::string g_field;

int fail(int status, std::string field, std::string message) {
  g_field = std::move(field);
  g_message = std::move(message);
  return status;
}

// Runs `body` (returning DATTN_OK) with every exception mapped to its status.
template <class Body>
int guarded(Body&& body) noexcept {
  try {
    return body();
  } catch (const dattn::InvalidArgument& e) {
    return fail(DATTN_INVALID_ARGUMENT, e.field(), e.what());
  } catch (const dattn::Unsupported& e) {
    return fail(DATTN_UNSUPPORTED, e.field(), e.what());
  } catch (const dattn::NotAvailable& e) {
    return fail(DATTN_NOT_AVAILABLE, e.field(), e.what());
  } catch (const dattn::Error& e) {
    return fail(DATTN_INTERNAL_ERROR, e.field(), e.what());
  } catch (const std::bad_alloc&) {
    return fail(DATTN_OUT_OF_MEMORY, "", "out of memory");
  } catch (const std::exception& e) {
    return fail(DATTN_INTERNAL_ERROR, "", e.what());
  } catch (...) {
    return fail(DATTN_INTERNAL_ERROR, "", "unknown error");
  }
}

[[noreturn]] void invalid(const std::string& field, const std::string& message) {
  throw dattn::InvalidArgument(field, field + ": " + message);
}

// Whether a struct the caller sized `size` bytes holds the member at `offset` of `bytes`.
bool holds(std::size_t size, std::size_t offset, std::size_t bytes) {
  return size >= offset + bytes;
}
#define DATTN_HOLDS(s, T, m) holds((s)->struct_size, offsetof(T, m), sizeof((s)->m))

dattn::TensorView view_of(const DLTensor* t, const std::string& field) {
  if (t == nullptr) invalid(field, "is NULL; a DLTensor is required");
  if (t->data == nullptr && t->ndim > 0) {
    bool empty = false;
    for (int d = 0; d < t->ndim; ++d) empty = empty || (t->shape != nullptr && t->shape[d] == 0);
    if (!empty) invalid(field, "has NULL data");
  }
  try {
    return dattn::from_dlpack(*t);
  } catch (const dattn::InvalidArgument& e) {
    invalid(field, e.what());  // the same message, naming the argument
  } catch (const dattn::Unsupported& e) {
    throw dattn::Unsupported(field, field + ": " + e.what());
  }
}

std::optional<dattn::TensorView> optional_view(const DLTensor* t, const std::string& field) {
  if (t == nullptr) return std::nullopt;
  return view_of(t, field);
}

dattn::AttentionConfig config_from(const dattn_layer_config* c) {
  if (c == nullptr) invalid("config", "is NULL");
  if (c->struct_size < offsetof(dattn_layer_config, threads) + sizeof(c->threads))
    invalid("struct_size",
            "is " + std::to_string(c->struct_size) +
                "; set it with dattn_layer_config_init (at least " +
                std::to_string(offsetof(dattn_layer_config, threads) + sizeof(c->threads)) +
                " bytes)");
  dattn::AttentionConfig config;
  if (c->num_heads < 1) invalid("num_heads", "must be >= 1, got " + std::to_string(c->num_heads));
  if (c->head_size < 1) invalid("head_size", "must be >= 1, got " + std::to_string(c->head_size));
  if (c->num_kv_heads < 0)
    invalid("num_kv_heads", "must be >= 0 (0: num_heads), got " + std::to_string(c->num_kv_heads));
  if (c->threads < 0)
    invalid("threads", "must be >= 0 (0: OpenMP's default), got " + std::to_string(c->threads));
  if (!(c->softmax_scale >= 0.0f) || !std::isfinite(c->softmax_scale))
    invalid("softmax_scale", "must be a finite number >= 0 (0: 1 / sqrt(head_size))");
  config.num_heads = c->num_heads;
  config.head_size = c->head_size;
  if (c->num_kv_heads > 0) config.num_kv_heads = c->num_kv_heads;
  if (c->softmax_scale > 0.0f) config.softmax_scale = double(c->softmax_scale);
  config.causal = c->causal != 0;
  if (c->backend != nullptr) config.backend = c->backend;
  if (DATTN_HOLDS(c, dattn_layer_config, prefix) && c->prefix != nullptr) config.prefix = c->prefix;
  if (c->options != nullptr)
    for (const char* const* o = c->options; *o != nullptr; ++o) {
      const std::string_view item(*o);
      const std::size_t eq = item.find('=');
      const std::string key(
          dattn::detail::trimmed(item.substr(0, eq == std::string_view::npos ? 0 : eq)));
      if (eq == std::string_view::npos || key.empty())
        invalid("options", "'" + std::string(item) + "' is not key=value");
      if (config.backend_options.count(key)) invalid("options", "'" + key + "' is given twice");
      config.backend_options.emplace(key, dattn::parse_option_value(item.substr(eq + 1)));
    }
  return config;
}

dattn::AttentionMetadata metadata_from(const dattn_call* c) {
  dattn::AttentionMetadata m;
  if (c == nullptr) return m;
  if (c->struct_size < offsetof(dattn_call, attn_mask) + sizeof(c->attn_mask))
    invalid("struct_size",
            "of dattn_call is " + std::to_string(c->struct_size) + "; set it with dattn_call_init");
  m.attn_mask = optional_view(c->attn_mask, "attn_mask");
  if (DATTN_HOLDS(c, dattn_call, joint_attn_mask)) {
    m.joint_query = optional_view(c->joint_query, "joint_query");
    m.joint_key = optional_view(c->joint_key, "joint_key");
    m.joint_value = optional_view(c->joint_value, "joint_value");
    m.joint_attn_mask = optional_view(c->joint_attn_mask, "joint_attn_mask");
  }
  if (DATTN_HOLDS(c, dattn_call, joint_strategy)) {
    if (c->joint_strategy != DATTN_JOINT_FRONT && c->joint_strategy != DATTN_JOINT_REAR)
      invalid("joint_strategy", std::to_string(c->joint_strategy) +
                                    " is not valid; valid: DATTN_JOINT_FRONT (0), "
                                    "DATTN_JOINT_REAR (1)");
    m.joint_strategy = c->joint_strategy == DATTN_JOINT_REAR ? dattn::JointStrategy::rear
                                                             : dattn::JointStrategy::front;
  }
  if (DATTN_HOLDS(c, dattn_call, cu_seqlens_k)) {
    m.extra.cu_seqlens_q = optional_view(c->cu_seqlens_q, "cu_seqlens_q");
    m.extra.cu_seqlens_k = optional_view(c->cu_seqlens_k, "cu_seqlens_k");
  }
  if (DATTN_HOLDS(c, dattn_call, max_seqlen_k)) {
    if (c->max_seqlen_q < 0 || c->max_seqlen_k < 0)
      invalid(c->max_seqlen_q < 0 ? "max_seqlen_q" : "max_seqlen_k", "must be >= 0 (0: not given)");
    if (c->max_seqlen_q > 0) m.extra.max_seqlen_q = c->max_seqlen_q;
    if (c->max_seqlen_k > 0) m.extra.max_seqlen_k = c->max_seqlen_k;
  }
  if (DATTN_HOLDS(c, dattn_call, valid_kv_length)) {
    if (c->valid_kv_length < -1)
      invalid("valid_kv_length",
              "must be >= 0, or -1 for all keys; got " + std::to_string(c->valid_kv_length));
    if (c->valid_kv_length >= 0) m.extra.valid_kv_length = c->valid_kv_length;
  }
  return m;
}

}  // namespace

extern "C" {

void dattn_layer_config_init(dattn_layer_config* config) {
  if (config == nullptr) return;
  std::memset(config, 0, sizeof *config);
  config->struct_size = sizeof *config;
}

void dattn_call_init(dattn_call* call) {
  if (call == nullptr) return;
  std::memset(call, 0, sizeof *call);
  call->struct_size = sizeof *call;
  call->joint_strategy = DATTN_JOINT_FRONT;
  call->valid_kv_length = -1;
}

int dattn_layer_create(const dattn_layer_config* config, dattn_layer** out) {
  if (out != nullptr) *out = nullptr;
  return guarded([&] {
    if (out == nullptr) invalid("out", "is NULL; pass the address of a dattn_layer*");
    dattn::AttentionConfig c = config_from(config);
    auto layer = std::unique_ptr<dattn_layer>(
        new dattn_layer{dattn::Attention(std::move(c)), config->threads, std::string()});
    layer->backend = std::string(layer->attention.backend().name());
    *out = layer.release();
    return int(DATTN_OK);
  });
}

void dattn_layer_destroy(dattn_layer* layer) {
  delete layer;
}

int dattn_forward(dattn_layer* layer, const DLTensor* q, const DLTensor* k, const DLTensor* v,
                  const dattn_call* call, DLTensor* out, DLTensor* lse) {
  return guarded([&] {
    if (layer == nullptr) invalid("layer", "is NULL; create it with dattn_layer_create");
    const dattn::TensorView qv = view_of(q, "query"), kv = view_of(k, "key"),
                            vv = view_of(v, "value"), ov = view_of(out, "out");
    std::optional<dattn::TensorView> lv;
    if (lse != nullptr) lv = view_of(lse, "lse");
    const dattn::AttentionMetadata meta = metadata_from(call);
    const dattn::ScopedThreads threads(layer->threads);
    layer->attention.forward_into(qv, kv, vv, meta, ov, lv);
    return int(DATTN_OK);
  });
}

const char* dattn_layer_backend(const dattn_layer* layer) {
  return layer == nullptr ? "" : layer->backend.c_str();
}

const char* dattn_last_error(void) {
  return g_message.c_str();
}

const char* dattn_last_error_field(void) {
  return g_field.c_str();
}

int dattn_set_last_error(int status, const char* field, const char* message) {
  try {
    return fail(status, field != nullptr ? field : "", message != nullptr ? message : "");
  } catch (...) {
    return status;  // the message could not be stored (out of memory)
  }
}

int dattn_get_memory_stats(dattn_memory_stats* stats) {
  return guarded([&] {
    if (stats == nullptr) return fail(DATTN_INVALID_ARGUMENT, "stats", "stats: is NULL");
    if (stats->struct_size < sizeof(dattn_memory_stats))
      return fail(DATTN_INVALID_ARGUMENT, "stats.struct_size",
                  "stats.struct_size = " + std::to_string(stats->struct_size) +
                      " is not valid; want " + std::to_string(sizeof(dattn_memory_stats)) +
                      " (sizeof(dattn_memory_stats))");
    const dattn::MemoryStats m = dattn::memory_stats();
    stats->idle_bytes = m.idle_bytes;
    stats->idle_buffers = m.idle_buffers;
    stats->in_use_bytes = m.in_use_bytes;
    stats->calls_in_flight = m.calls_in_flight;
    stats->live_layers = m.live_layers;
    return int(DATTN_OK);
  });
}

size_t dattn_empty_cache(void) {
  return dattn::empty_cache();
}

const char* dattn_version(void) {
  return DATTN_VERSION_STRING;
}

int dattn_abi_version(void) {
  return DATTN_ABI_VERSION;
}

}  // extern "C"
