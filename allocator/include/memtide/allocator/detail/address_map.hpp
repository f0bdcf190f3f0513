#pragma once
/// @file
/// Address -> value map for the allocator's live blocks: open addressing with linear probing and
/// backward-shift deletion (no tombstones), so lookups touch one or two cache lines and neither
/// insert nor erase allocates once the table has grown to the working set. Keys are device
/// addresses, never 0. Not thread-safe (the allocator's lock covers it).

#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "memtide/core/assert.hpp"

namespace memtide::detail {

template <typename V>
class AddressMap {
 public:
  explicit AddressMap(std::size_t capacity = 1024) { rehash(std::bit_ceil(capacity < 16 ? 16 : capacity)); }

  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }

  /// Pointer to the value for `key`, or null.
  V* find(std::uintptr_t key) noexcept {
    for (std::size_t i = slot(key);; i = (i + 1) & mask_) {
      Entry& e = table_[i];
      if (e.key == key) return &e.value;
      if (e.key == 0) return nullptr;
    }
  }

  const V* find(std::uintptr_t key) const noexcept { return const_cast<AddressMap*>(this)->find(key); }

  /// Inserts `key` (which must not be present).
  void insert(std::uintptr_t key, V value) {
    MEMTIDE_ASSERT(key != 0);
    if ((size_ + 1) * 2 > table_.size()) rehash(table_.size() * 2);
    std::size_t i = slot(key);
    while (table_[i].key != 0) {
      MEMTIDE_ASSERT(table_[i].key != key);
      i = (i + 1) & mask_;
    }
    table_[i] = Entry{key, value};
    ++size_;
  }

  /// Removes `key`; returns false when it was not present.
  bool erase(std::uintptr_t key) noexcept {
    std::size_t i = slot(key);
    while (table_[i].key != key) {
      if (table_[i].key == 0) return false;
      i = (i + 1) & mask_;
    }
    // Backward shift: pull later entries of the probe run into the hole so no lookup stops early.
    for (std::size_t j = (i + 1) & mask_;; j = (j + 1) & mask_) {
      if (table_[j].key == 0) break;
      const std::size_t home = slot(table_[j].key);
      // Move j into the hole i unless its home lies cyclically in (i, j].
      const bool stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
      if (!stays) {
        table_[i] = table_[j];
        i = j;
      }
    }
    table_[i] = Entry{};
    --size_;
    return true;
  }

  template <typename F>
  void for_each(F&& f) const {
    for (const Entry& e : table_) {
      if (e.key != 0) f(e.key, e.value);
    }
  }

 private:
  struct Entry {
    std::uintptr_t key = 0;
    V value{};
  };

  [[nodiscard]] std::size_t slot(std::uintptr_t key) const noexcept {
    // Addresses are multiples of 512: drop those bits, then Fibonacci hashing spreads the rest.
    return static_cast<std::size_t>(((key >> 9) * 0x9E3779B97F4A7C15ULL) >> shift_);
  }

  void rehash(std::size_t capacity) {
    std::vector<Entry> old = std::move(table_);
    table_.assign(capacity, Entry{});
    mask_ = capacity - 1;
    shift_ = 64 - std::countr_zero(capacity);
    size_ = 0;
    for (const Entry& e : old) {
      if (e.key != 0) insert(e.key, e.value);
    }
  }

  std::vector<Entry> table_;
  std::size_t mask_ = 0;
  int shift_ = 0;
  std::size_t size_ = 0;
};

}  // namespace memtide::detail
