// JSON and HTML text helpers for the files Tally writes (profiler traces, snapshot diffs, reports,
// memory timelines, safetensors headers), JSON through nlohmann-json. In base/, the lowest
// layer, so that every layer that writes JSON or HTML shares them. Documents are read with
// nlohmann::json::parse.
#pragma once

#include <string>
#include <string_view>

namespace tally::base {

// `s` as a JSON string literal, quotes included (nlohmann-json's escaping): `"`, `\` and
// control characters escaped (\b, \f, \n, \r, \t by name, others as \u00XX); other characters,
// UTF-8 included, pass unchanged. Bytes that are not valid UTF-8 (a file name in another
// encoding, a string cut inside a character) never throw: each invalid sequence becomes U+FFFD,
// the replacement character, so the result is always valid JSON. `<`, `>` and `&` pass
// unchanged: text bound for an HTML <script> goes through script_safe as well.
std::string json_quote(std::string_view s);

// JSON text made safe inside an HTML <script> element: `<`, `>` and `&` (which JSON text has
// only inside strings) as \u escapes, so no "</script>" or "<!--" can form whatever a string
// holds. The JSON value is unchanged.
std::string script_safe(std::string_view json);

// Text for an HTML element or a quoted attribute value: `&`, `<`, `>` and `"` as character
// references (&amp; &lt; &gt; &quot;); every other byte passes unchanged.
std::string html_escape(std::string_view text);

}  // namespace tally::base
