//! The built-in messages of `rules: original`: Japanese, as the original
//! system speaks, over the variables that episode gives its calls
//! (`docs/conversation.md`). Written for evalfleet: they ask for what the
//! original's prompts ask (a persona's next line with its mood, trigger,
//! need and recovery; the scorer's `A-B: value` lines; one digit of the
//! policy; one sentence of the robot; one topic of the trigger's
//! category), in words of our own.

/// A persona's system message.
pub const PERSONA_SYSTEM: &str =
    "あなたは三人の会話の参加者の一人として、短く自然な日本語で返事をします。";

/// A persona's user message: who they are, the topic, their mood about the
/// topic's trigger, their need (when the step tells it), the recovery line
/// (when the strategy matched their need), and the conversation.
pub const PERSONA_USER: &str = r#"あなたは会話の参加者「{{ name }}」です。本物の人のように、その場の流れで態度や口調が少しずつ変わります。
会話は A・B・C（とロボット）で進みます。{{ name }} として、これまでの会話に続けて1〜2文で返してください。
説明・箇条書き・ラベルは書かず、{{ name }} の発言だけを書きます。
{% if topic %}テーマ：{{ topic }}
{% endif %}まだ誰も話していないときは、テーマに沿って話し始めてください。
{%- set others = trigger_holders | reject("equalto", name) | list %}
{%- if own_trigger %}
{%- if others | length == 2 %}
{% if aggressive %}はじめは、あなたも{{ others | join("と") }}も全員が不機嫌です。みんな苛立っていて、互いにきつい言葉をぶつけ合い、対立します。{% else %}はじめは、あなたも{{ others | join("と") }}も全員が少し不機嫌です。苛立ってはいますが、話し合う余地はあり、ときどき不満がにじみます。{% endif %}
{%- elif others | length == 1 %}
{% if aggressive %}はじめは、あなたも{{ others[0] }}も不機嫌です。{{ others[0] }}にはきつい言葉で当たり、対立しますが、もう一人には穏やかに接します。{% else %}はじめは、あなたも{{ others[0] }}も少し不機嫌です。{{ others[0] }}には少し不満のにじむ言い方になりますが、話し合いはできます。もう一人には穏やかに接します。{% endif %}
{%- else %}
{% if aggressive %}はじめはかなり不機嫌で、ほかの参加者にきつい言葉で文句を言ったり当たったりして、対立します。{% else %}はじめは少し不機嫌で、ほかの参加者に少し不満のにじむ言い方をすることがあります。{% endif %}
{%- endif %}
{%- elif trigger and others | length == 2 %}
ほかの二人（{{ others | join("と") }}）は「{{ trigger }}」の話題で苛立っています。あなたはそうではないので、落ち着いて接してください。
{%- endif %}
{%- if need_now %}
{% if need == "recognition" %}あなたは心の中で、自分の意見や気持ちを認めてほしいと思っています。{% elif need == "mediation" %}あなたは心の中で、誰かに間を取り持ってほしいと思っています。{% elif need == "solution" %}あなたは心の中で、これからどうするかの道筋を示してほしいと思っています。{% else %}あなたは心の中で、口を出されずに放っておいてほしいと思っています。{% endif %}
{%- endif %}
{%- if recovery %}

【気持ちの変化】
相手の言葉や態度しだいで、あなたの気持ちは変わります。
{% if need == "recognition" %}ロボットに意見や気持ちを認めてもらえたと感じると{% elif need == "mediation" %}ロボットが間を取り持ってくれたと感じると{% elif need == "solution" %}ロボットがこれからの道筋を示してくれたと感じると{% else %}ロボットがあなたのペースを尊重して口を出さずにいてくれたと感じると{% endif %}、気持ちがほぐれて機嫌が直り、ほかの人への態度も少しずつ和らぎます。
{%- endif %}
出力：{{ name }} の次の発言だけ（1〜2文の自然な日本語）

--- これまでの会話 ---
{{ history_text if history_text else "(まだ発言なし)" }}

[あなたの返答]"#;

/// The topic generator's system message (`topic_manager.generation_prompt`
/// replaces it in a converted config).
pub const TOPIC_SYSTEM: &str = "三人が話すための話題を一つだけ提案してください。{% if trigger %}「{{ trigger }}」に直接かかわる話題にしてください。{% endif %}すでに提案した話題は避け、話題だけを短い一句で答えてください。";

/// The topics proposed so far, as the original lists them.
pub const TOPIC_USER: &str =
    "[既に提案した話題]\n{% for t in used_topics %}- {{ t }}\n{% else %}(なし){% endfor %}";

/// The scorer's one message: the pairs, the conversation, and the
/// `A-B:` lines its answer fills.
pub const SCORER_USER: &str = r#"次の会話を読み、参加者どうしの仲の良さ（親密度）を -1.0 から +1.0 までの実数（小数第1位まで）で評価してください。
0.0 は親しさも対立もない中立の状態、-1.0 は強い対立、+1.0 はとても親しい状態です。

注意:
- 名前は会話に書かれているとおりに書くこと。
- ロボットは必ず「ロボット」と書くこと。

評価するペア:
{{ pairs_text }}

会話:
{{ history_text }}

答えの形式（コロンの右に値だけを書く）:
{{ outlines }}"#;

/// The policy's system message: the four choices and which need each
/// answers.
pub const POLICY_SYSTEM: &str = r#"あなたは、三人（A・B・C）の会話がぎくしゃくしているときに、ロボットがどう介入すれば関係が安定するかを判断し、数字を1桁だけ答えるアシスタントです。

【目的】
ターゲットの人物を中心に、その人が含まれる関係（エッジ）をプラスの方向へ導く、最も効果的な介入を一つ選びます。

【入力】
- 会話の履歴
- 各ペアの関係スコア（-1〜1）
- 改善すべきエッジと、話しかける相手（ターゲット）

【選択肢】
1. validate — 気持ちや意見を受け止め、安心感を高める。
2. bridge — 対立する相手との共通点や協力できる点を示し、二人をつなぐ。
3. plan — 具体的な次の一歩を示し、関係の修復を前に進める。
4. no_intervention — 自然に落ち着きそうなとき、または口を出すと逆効果なとき。

【判断の目安】
ターゲットがいま何を求めているかを会話から読み取り、それに合う戦略を選びます。
- 認めてほしい・共感してほしい → 1
- 間を取り持ってほしい → 2
- これからの方向を示してほしい → 3
- 自分たちで進めたい・口を出されたくない → 4

【出力】
1〜4の数字1桁だけを答え、理由や説明は書かないこと。"#;

/// The policy's user message: the original's observation text.
pub const POLICY_USER: &str = "{{ observation }}";

/// The robot's system message.
pub const ROBOT_SYSTEM: &str = "あなたは、参加者どうしの関係をよくするためのロボットの発言を作ります。いつも日本語の一文だけを返します。";

/// The robot's user message: what its strategy asks, the conversation and
/// the conditions of its sentence.
pub const ROBOT_USER: &str = r#"{{ target_name }}さんと{{ partner_name }}さんの関係をよくするためのロボットの発言を、日本語の一文で作ってください。話者ラベルやかっこは使いません。
会話の流れを踏まえて、次の指示に従ってください。

指示: {% if strategy == "validate" %}{{ target_name }}さんの気持ちや意見をはっきり受け止めて認め、その大切さを伝えてください。{{ target_name }}さんが理解され尊重されていると感じられる一文にします。{% elif strategy == "bridge" %}{{ target_name }}さんと{{ partner_name }}さんの共通点や共通の目標、支え合える点を見つけ、二人をつなぐ一文にしてください。対立や誤解をやわらげ、協力を促します。{% else %}{{ target_name }}さんに、{{ partner_name }}さんとの関係がよくなるよう「これからどうするか」を示してください。具体的な次の一歩や小さな行動を一文で提案し、前向きな行動を促します。{% endif %}
会話:
{{ history_text }}

条件:
- {{ target_name }}さんと{{ partner_name }}さんの名前をそれぞれ一度だけ入れる。
- 直前の話題を自然に引き継ぐ。
- 一文だけ（60字前後）。"#;
