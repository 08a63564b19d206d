#include "dedup.h"

#include <algorithm>

namespace offcache {
namespace {

// Inference tensors have no version counter: only CPU ones, whose bytes the
// engine compares on every hit, can be deduplicated.
bool trackable(const at::Tensor& t) { return !t.is_inference() || t.device().is_cpu(); }

uint32_t version_of(const at::Tensor& t) {
  return t.is_inference() ? 0 : t.unsafeGetTensorImpl()->version_counter().current_version();
}

}  // namespace

const DedupTable::Entry* DedupTable::live_entry(const at::Tensor& source,
                                                c10::Device target) const {
  if (!trackable(source)) return nullptr;
  auto it = entries_.find(source.unsafeGetTensorImpl());
  if (it == entries_.end()) return nullptr;
  const Entry& e = it->second;
  // The weak reference pins the TensorImpl's address, so a live match is the
  // same tensor, not a new one allocated where a dead one was.
  if (e.source.expired() || e.target != target || !matches(e, source)) return nullptr;
  return &e;
}

std::optional<DedupTable::Candidate> DedupTable::candidate(const at::Tensor& source,
                                                           c10::Device target) const {
  const Entry* e = live_entry(source, target);
  if (e == nullptr || e->stored.expired()) return std::nullopt;
  return Candidate{e->stored, e->stored_version};  // a weak count only: no Python
}

std::optional<at::Tensor> DedupTable::take(const Candidate& c, std::vector<at::Tensor>& dropped) {
  // lock() may incref the stored copy's Python object (its only owner): the GIL.
  auto stored = c.stored.lock();
  if (!stored) return std::nullopt;
  at::Tensor copy(std::move(stored));
  if (version_of(copy) != c.stored_version) {  // the stored copy was edited
    dropped.push_back(std::move(copy));
    return std::nullopt;
  }
  return copy;
}

bool DedupTable::confirm(const at::Tensor& source, c10::Device target,
                         const at::Tensor& stored) const {
  const Entry* e = live_entry(source, target);
  // `stored` is alive (held by the caller): its address names it.
  return e != nullptr && e->stored._unsafe_get_target() == stored.unsafeGetTensorImpl() &&
         version_of(stored) == e->stored_version;
}

bool DedupTable::matches(const Entry& e, const at::Tensor& t) {
  return e.version == version_of(t) && e.storage == t.storage().unsafeGetStorageImpl() &&
         e.data == t.data_ptr() && e.dtype == t.dtype() && t.sizes().equals(e.sizes) &&
         t.strides().equals(e.strides) && e.requires_grad == t.requires_grad();
}

void DedupTable::insert(const at::Tensor& source, const at::Tensor& stored, c10::Device target) {
  if (!trackable(source) || source.is_same(stored)) return;
  auto* impl = source.unsafeGetTensorImpl();
  entries_.insert_or_assign(
      impl, Entry{c10::weak_intrusive_ptr<c10::TensorImpl>(source.getIntrusivePtr()),
                  c10::weak_intrusive_ptr<c10::TensorImpl>(stored.getIntrusivePtr()),
                  version_of(source), version_of(stored), source.storage().unsafeGetStorageImpl(),
                  source.data_ptr(), source.dtype(), source.sizes().vec(), source.strides().vec(),
                  source.requires_grad(), target});
  // Sweeping once inserts outnumber the entries that survived the last sweep
  // keeps the table within twice its live entries (plus 1024), at O(1) amortised.
  if (++inserts_since_sweep_ >= std::max<size_t>(1024, live_after_sweep_)) sweep();
}

void DedupTable::sweep() {
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->second.source.expired() || it->second.stored.expired()) {
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
  inserts_since_sweep_ = 0;
  live_after_sweep_ = entries_.size();
}

}  // namespace offcache
