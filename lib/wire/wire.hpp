// refit — the wire format: every message, its msgpack encoding, and the validation of everything
// that arrives. The only place that knows the byte layout of a message. What a transport puts in
// the fields that are its own (HELLO's `session` and buffer handles, OK's `handles`) is opaque
// bytes here: only that transport decodes them, and each such decoder is fuzzed like these.
//
// A message is a msgpack array whose first element is the message type and whose second is the
// protocol version; the remaining elements are the message's fields, in the order of the structs
// below. decode() checks structure and every stateless rule (types, ranges, dtype, shape × itemsize
// against the byte range); refit_tracker checks the rules that need the session's state
// (buffer index and bounds, sequence, version, duplicates, completeness).
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <variant>
#include <vector>

#include "refit/error.hpp"
#include "refit/model.hpp"
#include "wire/names.hpp"

namespace refit::wire {

/// Bumped on every incompatible change of the format below. A new message type is not one: a
/// receiver that does not know it refuses it as malformed (an older receiver answers ABORT with
/// ERROR and aborts the refit all the same), and a streamer never receives a request.
inline constexpr std::uint32_t protocol_version = 12;

/// Limits that bound what a decoder accepts (hostile input must not allocate without bound).
inline constexpr std::size_t max_message_bytes = 64u << 20;
inline constexpr std::size_t max_name_bytes = 4096;
inline constexpr std::size_t max_rank = 8;  ///< dimensions of a shape
inline constexpr std::size_t max_buffers = 64;
inline constexpr std::size_t max_entries = 1u << 20;  ///< elements of a list (handles, sources, ...)
/// Entries of one BATCH (plan_options::max_entries may not exceed it). Lower than max_entries
/// because an entry is the message's costliest element to decode: a BATCH of this many entries of
/// the smallest kind (~14 bytes of wire each) costs the decoder ~24 MB for ~0.9 MB of input.
inline constexpr std::size_t max_batch_entries = 1u << 16;
inline constexpr std::size_t max_handle_bytes = 4096;
inline constexpr std::uint64_t max_group_size = 4096;  ///< streamers of one group
inline constexpr std::size_t max_secret_bytes = 64;    ///< hello::secret and a request's secret

enum class msg_type : std::uint8_t {
  hello = 1,
  begin = 2,
  batch = 3,
  end = 4,
  bye = 5,
  ok = 6,
  error = 7,
  abort = 8,   ///< a request, like HELLO..BYE; numbered after the replies because codes never change
  commit = 9,  ///< a request: an engine-wide version every receiver prepared may commit (end::hold)
};
std::string_view to_string(msg_type t) noexcept;  // "HELLO", "BEGIN", ...

/// One shared buffer as announced in HELLO. `handle` is transport-specific bytes: the shm object
/// name (host_shm), the raw cudaIpcMemHandle_t (cuda_ipc); the event handles are raw
/// cudaIpcEventHandle_t bytes (cuda_ipc) or empty.
struct buffer_desc {
  std::uint64_t bytes = 0;
  std::string handle;
  std::string packed_event;
  std::string applied_event;
  friend bool operator==(const buffer_desc&, const buffer_desc&) = default;
};

/// How a session moves bytes, negotiated at HELLO: the streamer asks, each receiver's reply grants.
enum class session_mode : std::uint8_t {
  buffers = 0,   ///< through the ping-pong buffers (staged, packed)
  in_place = 1,  ///< written where the receiver's weights are: cuda_ipc direct, nccl in place
};
std::string_view to_string(session_mode m) noexcept;

/// Streamer → receiver, once per session.
struct hello {
  std::string token;        ///< session token ("" when none)
  std::string transport;    ///< "host_shm", "cuda_ipc", "nccl"
  std::string peer;         ///< "host:pid" of the streamer, for messages
  std::string host_id;      ///< hostname + boot id: same value ⇔ same host
  std::string device_uuid;  ///< cuda: the 16-byte UUID of the streamer's GPU
  std::uint64_t alignment = 256;
  std::vector<buffer_desc> buffers;
  /// The transport's own session data for this receiver (transport::source::hello_for), opaque
  /// here: nccl's communicator id and this receiver's rank. At most max_handle_bytes.
  std::string session;
  session_mode mode = session_mode::buffers;  ///< what the streamer asks for
  /// The digest of the engine layout (route table) the streamer's side was set up for, "" when
  /// none: a receiver set up for another refuses the session.
  std::string layout;
  /// The streamer is rank `group_rank` of `group_size` streamers that send one version together
  /// (sharded trainers); 0 of 1 for a streamer alone. 1 <= group_size <= max_group_size,
  /// group_rank < group_size.
  std::uint64_t group_rank = 0;
  std::uint64_t group_size = 1;
  /// How long the streamer waits for any reply (streamer_options::timeout), 0 when it does not
  /// say: a group's receiver ends a version within it while this streamer's END waits for the
  /// others', so that the streamer hears how it ended before it gives up.
  std::uint64_t reply_timeout_ms = 0;
  /// The streamer would take its requests through a shared-memory control lane when it is on the
  /// receiver's host (streamer_options::control_lane; see channel::lane): the receiver offers one
  /// in its OK.
  bool lane = false;
  /// The session secret the streamer chose for this session (refit's streamer: 16 random bytes
  /// each HELLO; at most max_secret_bytes, "" for none). Every later request of the session
  /// carries it (encode(m, secret)); the receiver takes them only from the connection that said
  /// this HELLO and with this secret, and refuses others with errc::unauthorized.
  std::string secret;
  friend bool operator==(const hello&, const hello&) = default;
};

/// Starts refit `version`.
///
/// `subset`: the version carries only some of the receiver's tensors (LoRA adapters, the tensors
/// that changed); the receiver keeps the others from the version it holds, so it needs one: a
/// committed whole version and clean weights. `base`: a delta — patches against version `base`,
/// which the receiver must hold exactly (its committed version, not dirty, not poisoned) or it
/// refuses BEGIN with errc::needs_whole before writing anything. A delta is always a subset
/// (tensors that did not change are not sent), and its base is older than its version.
struct begin {
  std::uint64_t version = 0;
  bool subset = false;
  std::optional<std::uint64_t> base;
  friend bool operator==(const begin&, const begin&) = default;
};

/// What an entry's buffer bytes are.
enum class entry_kind : std::uint8_t {
  bytes = 0,  ///< the tensor's bytes [tensor_offset, tensor_offset + bytes), as they are
  /// A patch of the tensor's bytes [tensor_offset, tensor_offset + span) (delta versions only):
  /// n = bytes / (4 + itemsize) changes, laid out as n little-endian u32 element indices
  /// (relative to tensor_offset / itemsize, strictly increasing, each < span / itemsize) followed
  /// by the n new element values (itemsize bytes each). See lib/delta/patch.hpp.
  patch = 1,
};
std::string_view to_string(entry_kind k) noexcept;

/// One entry: bytes [tensor_offset, tensor_offset + bytes) of tensor `name`, at `buffer_offset`;
/// or (kind patch) a patch of `bytes` buffer bytes that covers the tensor's bytes
/// [tensor_offset, tensor_offset + span).
struct entry {
  std::string name;
  dtype type = dtype::u8;
  std::vector<std::int64_t> shape;
  std::uint64_t tensor_offset = 0;
  std::uint64_t bytes = 0;  ///< in the buffer
  std::uint64_t buffer_offset = 0;
  entry_kind kind = entry_kind::bytes;
  std::uint64_t span = 0;  ///< patch: the tensor bytes it covers; bytes: 0 on the wire, read as `bytes`
  /// Where the bytes are: 0 in the batch's buffer, at buffer_offset; k ≥ 1 in the streamer's own
  /// memory announced k-th in this refit (batch::sources), at buffer_offset there, read by the
  /// receiver where it is (cuda_ipc: the streamer's tensor, mapped). Only entries of kind bytes.
  std::uint32_t source = 0;
  /// The tensor bytes this entry accounts for (chunks must cover a tensor contiguously).
  [[nodiscard]] std::uint64_t covered() const noexcept { return kind == entry_kind::patch ? span : bytes; }
  friend bool operator==(const entry&, const entry&) = default;
};

/// The content of one buffer. `seq` counts batches of the refit from 0.
struct batch {
  std::uint64_t version = 0;
  std::uint64_t seq = 0;
  std::uint32_t buffer = 0;
  std::vector<entry> entries;
  /// Memory of the streamer that entries read where it is (entry::source), announced by the first
  /// batch of the refit that reads it and numbered on from the sources of earlier batches: one
  /// transport record each (cuda_ipc: an allocation's cudaIpcMemHandle_t), at most
  /// max_handle_bytes. Only transports that map a streamer's memory accept any (sink::map_sources).
  std::vector<std::string> sources{};
  /// True when nothing of the batch waits for the streamer's GPU work: nothing was packed into the
  /// buffer, and the tensors its entries read were complete when it was sent. The receiver then
  /// reads without ordering after the streamer's stream (sink::begin_read).
  bool ready = false;
  friend bool operator==(const batch&, const batch&) = default;
};

/// Ends refit `version`: the receiver commits if what it received matches these totals.
struct end {
  std::uint64_t version = 0;
  std::uint64_t tensors = 0;
  std::uint64_t bytes = 0;  ///< buffer bytes (a patch counts its own bytes, not the span it covers)
  std::uint64_t batches = 0;
  /// The streamer's checksum of the whole new version (delta::version_checksum: every tensor it
  /// holds, sent or not), when it keeps a base; required for a delta, whose receiver checks it.
  std::optional<std::uint64_t> checksum;
  /// An engine-wide version (streamer_options::atomic): the receiver checks the version as at any
  /// END and answers OK once it is *prepared* (whole and checked, nothing committed, in place or in
  /// its stage), then waits for COMMIT of it (or ABORT, or its idle timeout) before it commits (in
  /// place) or reports it prepared to the engine (staged). So a version reaches every receiver of
  /// the streamer or none, short of the streamer dying between two of its COMMITs.
  bool hold = false;
  friend bool operator==(const end&, const end&) = default;
};

/// Streamer -> receiver: every receiver prepared engine-wide version `version` (its END with
/// hold was answered OK by all of them): commit it.
struct commit {
  std::uint64_t version = 0;
  friend bool operator==(const commit&, const commit&) = default;
};

/// Ends the session.
struct bye {
  friend bool operator==(const bye&, const bye&) = default;
};

/// Streamer → receiver: the streamer failed refit `version` on its own side after BEGIN (a tensor
/// it could not send, its source threw), so the refit will never reach END. `code` is the error
/// the streamer's caller gets; `reason` its message (see max_text_bytes). The receiver aborts the refit if it is the
/// one in progress and answers OK in every case.
struct abort {
  std::uint64_t version = 0;
  errc code = errc::internal;
  std::string reason;
  friend bool operator==(const abort&, const abort&) = default;
};

/// A receiver's request, in its OK to HELLO, that the streamer send tensor `name` as `type`
/// (quantised as `q` when f8_e4m3 or f4_e2m1x2, with its scale tensor `name` + refit::scale_suffix,
/// and for nvfp4 `name` + refit::scale_2_suffix): see
/// refit::tensor_dest. Listed for every destination of a float dtype (the receiver does not know
/// the source's); the streamer converts the names whose source differs.
struct conversion {
  std::string name;
  dtype type = dtype::f32;
  quant q = quant::none;
  /// Where the block scales go (mxfp8, nvfp4): a fourth element of the descriptor, sent only when
  /// not row-major (a peer of an older refit refuses it by the length).
  scale_layout layout = scale_layout::row_major;
  friend bool operator==(const conversion&, const conversion&) = default;
};

/// Success reply. `handles` carries what the receiver exports in reply to HELLO (transport
/// specific, may be empty); `mode` what it grants of what HELLO asked (buffers in other replies);
/// `convert` the dtypes it wants (HELLO's reply only). Rules: `type` is f32, bf16, f16 or
/// f8_e4m3; f8_e4m3 has a quant other than none and the others none; no name twice.
struct ok {
  std::optional<std::uint64_t> committed;
  bool dirty = false;
  std::vector<std::string> handles;
  session_mode mode = session_mode::buffers;
  std::vector<conversion> convert;
  /// HELLO's reply only: the shared-memory control lane the receiver made for this session
  /// (channel::lane::offer(), opaque here), "" for none. At most max_handle_bytes.
  std::string lane;
  friend bool operator==(const ok&, const ok&) = default;
};

/// The most bytes of an ERROR's message or an ABORT's reason, as encoded and as decoded: each is
/// printable text (model/text.hpp: valid UTF-8, one line, escaped, cut to this many bytes), since
/// the streamer's caller reads it, a log quotes it and the bench writes it into JSON.
inline constexpr std::size_t max_text_bytes = 8192;

/// Failure reply. `message`: see max_text_bytes.
struct error {
  errc code = errc::protocol;
  std::string message;
  friend bool operator==(const error&, const error&) = default;
};

using message = std::variant<hello, begin, batch, end, bye, ok, error, abort, commit>;

msg_type type_of(const message& m) noexcept;

/// One destination of a receiver's direct offer (cuda_ipc): a view of the receiver's weights the
/// streamer writes a source into (see refit::dest_layout), at `offset` bytes into allocation
/// `allocation` of the offer (no_allocation for a view with no bytes).
struct dest_record {
  static constexpr std::uint64_t no_allocation = ~std::uint64_t{0};
  std::string name;
  dtype type = dtype::u8;
  std::vector<std::int64_t> shape;    ///< the view's
  std::vector<std::int64_t> strides;  ///< empty: dense
  std::optional<source_slice> slice;
  std::uint64_t allocation = 0;
  std::uint64_t offset = 0;
  friend bool operator==(const dest_record&, const dest_record&) = default;
};

/// msgpack [name, dtype, shape, strides, slice ([dim, start, length]) or nil, allocation, offset].
std::string encode_dest(const dest_record& d);
/// Decodes and validates (every field, and the view itself as add_parameter checks it). Throws
/// refit::error(protocol) naming the field.
dest_record decode_dest(std::string_view bytes);

/// Encodes a message (never fails for a well-formed struct). A request of a session (BEGIN, BATCH,
/// END, BYE, ABORT, COMMIT) carries `secret` as its last field: the session's hello::secret ("" for none);
/// other messages ignore it.
std::string encode(const message& m, std::string_view secret = {});
/// Encodes a BATCH as encode(message(b), secret) does, without copying its entries into a message.
std::string encode(const batch& b, std::string_view secret = {});

/// Decodes and validates everything that needs no session state. Throws refit::error with
/// errc::version_mismatch (message names both versions), or errc::protocol with a message naming
/// the message type, the field and what is wrong. `secret`, when given, receives the secret a
/// request of a session carries ("" for other messages).
message decode(std::span<const std::byte> bytes, std::string* secret = nullptr);
message decode(std::string_view bytes, std::string* secret = nullptr);

/// Receiver-side state of one refit: applies the stateful rules to each batch.
///
/// Rules: begin() needs no refit in progress' version to be reused and a version greater than the
/// committed one; check() needs version == the refit's, seq == batches seen, buffer < buffer count,
/// buffer_offset + bytes <= that buffer's size, entries of a batch not overlapping, at most
/// max_entries entries, every name's chunks in order and contiguous from offset 0 (a patch entry
/// covers its span), patch entries only in a delta, the same dtype and shape for every chunk of a
/// name, and no name after it completed. finish() needs
/// version == the refit's, every started tensor complete, and the END totals equal to what arrived.
/// Each violation throws refit::error(errc::protocol, or errc::incomplete for finish()).
///
/// A sharded tracker (one streamer of a group: hello::group_size > 1) takes each name as one
/// contiguous byte range that may start anywhere and end before the tensor does (the streamer's
/// shard); finish() then leaves it to the receiver to check that the group's ranges cover every
/// tensor exactly once (see ranges()).
class refit_tracker {
 public:
  /// `buffer_bytes[i]` is the size of buffer i of this session.
  explicit refit_tracker(std::vector<std::uint64_t> buffer_bytes, std::uint64_t max_entries = wire::max_batch_entries,
                         bool sharded = false);

  /// The bytes [first, next) of one tensor that arrived in this refit (a sharded tracker's).
  struct range {
    dtype type;
    std::vector<std::int64_t> shape;
    std::uint64_t first = 0;
    std::uint64_t next = 0;
    std::uint64_t total = 0;  ///< bytes of the whole tensor
  };

  /// Starts a refit. `committed`: the receiver's committed version, if any.
  void begin(const wire::begin& b, std::optional<std::uint64_t> committed);
  /// Checks a batch and records its entries.
  void check(const wire::batch& b);
  /// Checks END against what arrived.
  void finish(const wire::end& e);
  /// Forgets the refit in progress.
  void reset() noexcept;

  [[nodiscard]] bool active() const noexcept { return active_; }
  [[nodiscard]] std::uint64_t version() const noexcept { return version_; }
  [[nodiscard]] std::uint64_t batches() const noexcept { return next_seq_; }
  [[nodiscard]] std::uint64_t tensors_completed() const noexcept { return completed_.size(); }
  [[nodiscard]] std::uint64_t bytes() const noexcept { return bytes_; }
  /// Names that completed in this refit (contains(), size()).
  [[nodiscard]] const recycled_names& completed() const noexcept { return completed_; }
  [[nodiscard]] bool sharded() const noexcept { return sharded_; }
  /// A sharded tracker's ranges, by name (a tensor of this refit that arrived whole is among them too).
  [[nodiscard]] const std::unordered_map<std::string, range>& ranges() const noexcept { return partial_; }

 private:
  using partial = range;  ///< next: the next expected tensor offset
  /// A tensor's state as it will be once the batch being checked passes. It refers to the batch's
  /// entries and to partial_ (neither changes while a batch is checked), so that checking copies
  /// and allocates nothing: a direct session's batch has an entry per tensor of the model.
  struct staged {
    std::string_view name;
    dtype type = dtype::u8;
    std::span<const std::int64_t> shape;
    std::uint64_t first = 0;
    std::uint64_t next = 0;
    std::uint64_t total = 0;
    bool done = false;
    bool in_partial = false;  ///< partial_ holds its state from an earlier batch
  };

  // The steps of check(), in order; each throws at the first rule a batch breaks.
  void check_header(const wire::batch& b) const;
  void check_chunks(const wire::batch& b);
  void apply(std::uint64_t batch_bytes);
  /// The staged state of `name` in the batch being checked, or nullptr.
  staged* find_staged(std::string_view name);
  void add_staged(const staged& s);
  void add_completed(std::string_view name);

  std::vector<std::uint64_t> buffer_bytes_;
  std::uint64_t max_entries_;
  bool sharded_ = false;
  bool active_ = false;
  bool delta_ = false;  ///< BEGIN named a base: patch entries are allowed
  std::uint64_t version_ = 0;
  std::uint64_t next_seq_ = 0;
  std::uint64_t bytes_ = 0;
  std::uint64_t sources_ = 0;  ///< sources announced so far (batch::sources)
  std::unordered_map<std::string, partial> partial_;
  /// Its nodes are kept from earlier refits (reset()).
  recycled_names completed_;
  // Scratch of check(): the batch's staged states, and an open-addressing index of them by name
  // (position + 1, 0 for an empty slot; a power of two of slots, at least twice the entries).
  std::vector<staged> staged_;
  std::vector<std::uint32_t> index_;
};

}  // namespace refit::wire
