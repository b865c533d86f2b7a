// base/json.h: json_quote (nlohmann-json's escaping; invalid UTF-8 becomes U+FFFD, never an
// exception), script_safe (JSON text inside an HTML <script>) and html_escape (HTML text).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "base/json.h"

using tally::base::html_escape;
using tally::base::json_quote;
using tally::base::script_safe;

TEST(JsonQuote, EscapesQuotesBackslashesAndControlCharacters) {
  EXPECT_EQ(json_quote(""), R"("")");
  EXPECT_EQ(json_quote("plain"), R"("plain")");
  EXPECT_EQ(json_quote("a\"b\\c"), R"("a\"b\\c")");
  EXPECT_EQ(json_quote("\n\r\t\b\f"), R"("\n\r\t\b\f")");
  EXPECT_EQ(json_quote(std::string_view("\x01\x1f\0", 3)), R"("\u0001\u001f\u0000")");
  EXPECT_EQ(json_quote("</script>&"), R"("</script>&")");  // script_safe's job
}

TEST(JsonQuote, Utf8PassesAndInvalidBytesBecomeReplacementCharacters) {
  EXPECT_EQ(json_quote("caf\xc3\xa9 \xe2\x82\xac"), "\"caf\xc3\xa9 \xe2\x82\xac\"");
  EXPECT_EQ(json_quote("a\xff"
                       "b"),
            "\"a\xef\xbf\xbd"
            "b\"");
  EXPECT_EQ(json_quote("cut \xe2\x82"), "\"cut \xef\xbf\xbd\"");  // a character cut short
  // Whatever the bytes, the result parses back as one JSON string.
  const std::string odd = "\xc0\x80\xed\xa0\x80 \"\\\x7f";
  EXPECT_TRUE(nlohmann::json::parse(json_quote(odd)).is_string());
}

TEST(ScriptSafe, EscapesAngleBracketsAndAmpersands) {
  const std::string j = "{\"name\": " + json_quote("a</script><!--&") + "}";
  const std::string safe = script_safe(j);
  EXPECT_EQ(safe, R"({"name": "a\u003c/script\u003e\u003c!--\u0026"})");
  EXPECT_EQ(nlohmann::json::parse(safe), nlohmann::json::parse(j));
}

TEST(HtmlEscape, EscapesTheFourMarkupCharacters) {
  EXPECT_EQ(html_escape(""), "");
  EXPECT_EQ(html_escape("a <b> & \"c\" 'd'"), "a &lt;b&gt; &amp; &quot;c&quot; 'd'");
  EXPECT_EQ(html_escape("&amp;"), "&amp;amp;");  // escaped once more, never decoded
  EXPECT_EQ(html_escape("caf\xc3\xa9\n"), "caf\xc3\xa9\n");
}
